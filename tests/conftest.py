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

pytest_plugins = [p for p in ("tests.fixtures_server", "tests.fixtures_etcd", "tests.fixtures_router") if os.path.exists(
    os.path.join(os.path.dirname(__file__), p.split(".")[1] + ".py"))]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A complete HF directory of the tiny preset (seed 0), built once per session."""
    from bridge.presets import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)
