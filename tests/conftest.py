"""Shared fixtures. Component fixtures live in their own plugin modules, listed here."""

from __future__ import annotations

import os
import signal

import pytest

# A shell starts a script's background job with SIGINT ignored, and every process inherits that: the
# interrupt tests (real SIGINTs) would then test nothing. Python's own handler again, here and (reset to the
# default on exec) in every process a test starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The transports of tests/plugins are registered from outside the project, as a user's own would be
# (bridge.transports.registry): named in WSYNC_PLUGINS, importable by every process a test starts.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["WSYNC_PLUGINS"] = ",".join(sorted(
    f"tests.plugins.{name[:-3]}" for name in os.listdir(os.path.join(_REPO, "tests", "plugins"))
    if name.endswith(".py") and name != "__init__.py"))
os.environ["PYTHONPATH"] = os.pathsep.join([_REPO, *filter(None, [os.environ.get("PYTHONPATH")])])

pytest_plugins = [p for p in ("tests.fixtures_server", "tests.fixtures_etcd", "tests.fixtures_router", "tests.fixtures_sglang") if os.path.exists(
    os.path.join(os.path.dirname(__file__), p.split(".")[1] + ".py"))]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A complete HF directory of the tiny preset (seed 0), built once per session."""
    from bridge.local.presets import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


# ------------------------------------------------------------------ order: the longest files first
# scripts/test.sh runs the suite on 3 pytest-xdist workers, a whole file per worker at a time (fixtures
# scoped to a module, such as SGLang's harness, start once). The longest files start first, so that none
# starts last on one worker while the other idles. The order changes no result; keep it roughly right
# (``--durations`` prints the current figures).
LONGEST_FIRST = ("test_real_sglang.py", "test_readme.py", "test_multihost.py", "test_sglang_code.py", "test_interrupts.py",
                 "test_sglang_versions.py", "test_faults.py", "test_cuda_ipc.py", "test_cli.py",
                 "test_lora.py", "test_delta_sglang.py", "test_fleet.py", "test_disk_sync.py", "test_broadcast.py",
                 "test_name_resolve.py", "test_bench.py")


def pytest_collection_modifyitems(config, items) -> None:
    _deselect_other_releases(config, items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _deselect_other_releases(config, items) -> None:
    """A test of SGLang's code marked ``newest_release`` runs on the newest release only (one stands for all), one
    marked ``older_releases`` on every release but the newest (whose whole server runs it in the real tier): the
    other parametrizations are never collected, rather than skipped."""
    from tests.sglang_harness import VERSIONS

    def wanted(item) -> bool:
        version = getattr(item, "callspec", None) and item.callspec.params.get("server")
        if version is None:
            return True
        if item.get_closest_marker("newest_release"):
            return version == VERSIONS[0]
        if item.get_closest_marker("older_releases"):
            return version != VERSIONS[0]
        return True

    keep = [item for item in items if wanted(item)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not wanted(item)])
        items[:] = keep


# ------------------------------------------------------------------ strict mode: a skip is a failure
# A tier that skips because its machine lacks something (etcd, a router, SGLang's code, root) keeps a run
# green while testing nothing of that tier. In strict mode (CI sets CI=true; scripts/test.sh sets
# WSYNC_STRICT=1) the run checks the machine first and stops at once naming what to install, and a test
# that skips for a reason not listed here fails.
STRICT_ENV = "WSYNC_STRICT"

ALLOWED_SKIPS = (
    "needs CUDA",                   # the gpu tier and the CUDA-only paths of CPU tests (bench, client, cuda_ipc)
    "needs a CUDA device",
    "needs two CUDA devices",
    "needs sglang and CUDA",
    "this host has CUDA",           # the CPU-only error path, on a GPU host
)
"""Substrings of the skip reasons strict mode accepts: the tests that are meant to run elsewhere (a GPU
host) or once (one SGLang release stands for all)."""


def strict() -> bool:
    """True when a skip is a failure: ``CI`` or ``WSYNC_STRICT`` set to anything but empty, 0 or false."""
    return any(os.environ.get(name, "").lower() not in ("", "0", "false") for name in ("CI", STRICT_ENV))


def missing_prerequisites() -> list[str]:
    """What this machine lacks for some tier of the suite, each with what to install or change."""
    import importlib.util
    import shutil

    from tests.sglang_harness import ALL_VERSIONS, installed, sglang_dir

    missing = []
    if shutil.which("etcd") is None:
        missing.append("etcd is not on PATH: apt-get install etcd-server (the name-resolution tier)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        missing.append("ip or tc is not on PATH: apt-get install iproute2 (the multi-host tier, the link bench)")
    if os.geteuid() != 0:
        missing.append("not root: the multi-host tier builds network namespaces and the disk-full tests mount a "
                       "tmpfs; run the suite as root")
    if importlib.util.find_spec("sglang_router") is None or shutil.which("smg") is None:
        missing.append("sglang-router or smg is not installed: pip install 'sglang-router==0.3.2' 'smg==1.13.0' "
                       "(the fleet tier)")
    absent = [v for v in ALL_VERSIONS if not installed(v)]
    if absent:
        missing.append(f"SGLang {', '.join(absent)} not unpacked: bash scripts/install_sglang.sh (the sglang_code tier)")
    elif not os.path.exists(os.path.join(sglang_dir("0.5.23"), ".server-ok")):
        missing.append("SGLang 0.5.23's server was not checked on this host: bash scripts/install_sglang.sh (its step "
                       "`wsync sglang --check`; the real_sglang tier)")
    return missing


def pytest_sessionstart(session) -> None:
    if not strict() or session.config.option.collectonly:
        return
    missing = missing_prerequisites()
    if missing:
        pytest.exit("strict mode (CI or WSYNC_STRICT set): this machine cannot run the whole suite:\n  "
                    + "\n  ".join(missing) + "\n(bash scripts/test.sh installs all of it)", returncode=4)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and strict()) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"strict mode (CI or {STRICT_ENV} set): skipped for a reason not in "
                           f"tests/conftest.py ALLOWED_SKIPS: {reason}")
