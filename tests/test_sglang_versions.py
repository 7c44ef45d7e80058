"""The client's version gates, seen in SGLang's own code of every release that pins one (``sglang_code``).

For each installed release (``tests.sglang_harness.ALL_VERSIONS``; ``scripts/install_sglang.sh`` says which gate
each pins), the harness (SGLang's HTTP app, tokenizer-side and scheduler-side code of that release, see
:mod:`tests.sglang_harness.serve`) is started and probed over HTTP, and every fact a gate of
:class:`bridge.protocol.ProtocolFeatures` encodes is read off the answers -- nothing is taken from a table:

* ``info_routes``: ``/server_info`` and ``/model_info`` answer (not 404).
* ``get_weight_version_route``: ``/get_weight_version`` answers 200.
* ``weight_version_route``: ``/weight_version`` answers 200.
* ``weight_version``: ``/update_weight_version`` exists and ``/get_model_info`` then reports the new version,
  and SGLang's request parsing validates a ``weight_version`` field on ``/update_weights_from_distributed``.
* ``batched_distributed`` / ``flattened_bucket``: that parsing validates ``names`` / ``load_format`` (a field
  the release's request struct lacks is ignored, a field it has is refused when mistyped).
* ``pause_mode``: ``/pause_generation`` refuses ``{"mode": "bogus"}`` (a release without modes pauses).
* ``destroy_group``: ``/destroy_weights_update_group`` exists.
* ``needs_session``: ``/begin_weight_update`` exists and an update outside a session is refused.
* ``version_lost_when_paused``: an update from disk with a ``weight_version`` while paused leaves the old
  version reported.
* ``flush_asserts`` (at the two releases of its gate, 0.5.21 and 0.5.22; tests/test_sglang_code.py sees it at
  0.5.6 and 0.5.23): with a generation in flight and paused in place, an update asking for a flush kills the
  server (SGLang's ``assert flush_cache_success``) rather than failing.
* ``flush_refused_while_retracted`` (at 0.5.8, 0.5.20 and 0.5.21, the installed releases around its gate): with a
  generation in flight and paused by ``retract`` (it waits in SGLang's waiting queue), an update asking for a
  flush is refused (0.5.20: the scheduler asserts and dies) rather than applied.

The same probes (but the last two, which the reference server does not emulate: its updates are atomic and it
keeps no cache to flush) then run against the reference server started with ``--protocol-version`` of the
release's dialect (:func:`dialect`: releases whose emulated gates are all equal get one reference server, started
at the oldest of them), which must answer as SGLang's code of every release of that dialect did.

Where a release's own code loses the version of a disk load made while paused (0.5.6), the same load made
through :class:`bridge.client.ServerClient` must leave its version reported (issue 21: the client sets it
again), on SGLang's code and on the reference server of its dialect. Elsewhere the server keeps the version itself
(``version_lost_when_paused`` is False there, read off its code) and the client adds nothing.

Launches run two at a time in the background, in the order the tests need them, so the module costs about one
harness start per release and one reference-server start per dialect.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import re
import threading
import time

import pytest
import requests

from bridge.client import ServerClient
from bridge.protocol import ProtocolFeatures
from tests.sglang_harness import ALL_VERSIONS, installed, launch

pytestmark = pytest.mark.sglang_code

# The gates ProtocolFeatures encodes that the probes read; the reference server emulates all but the last two.
EMULATED = ("info_routes", "get_weight_version_route", "weight_version_route", "weight_version", "batched_distributed",
            "flattened_bucket", "pause_mode", "destroy_group", "needs_session")
BEHAVIOUR = ("version_lost_when_paused", "flush_asserts", "flush_refused_while_retracted")
# flush_asserts is probed at the releases on either side of its gate (the probe kills the server there).
FLUSH_PROBED = ("0.5.21", "0.5.22")
# flush_refused_while_retracted at the installed releases around its gate (0.5.9-0.5.20; between 0.5.8 and 0.5.20
# no release is installed). The probe kills 0.5.20.
RETRACT_FLUSH_PROBED = ("0.5.8", "0.5.20", "0.5.21")
# The releases whose own code loses the version of an update made while paused, which the client sets again.
LOSES_PAUSED_VERSION = tuple(v for v in ALL_VERSIONS if ProtocolFeatures.from_version(v).version_lost_when_paused)
PROBE_VERSION = "wsync-probe-v"
CLIENT_VERSION = "wsync-client-paused"


def _emulated_gates(version: str) -> tuple[bool, ...]:
    f = ProtocolFeatures.from_version(version)
    return tuple(getattr(f, k) for k in EMULATED)


def dialect(version: str) -> str:
    """The oldest installed release whose emulated gates all equal ``version``'s.

    The probes see a reference server's release only through those gates (its one other gate by release,
    ``/ready`` from 0.5.20, is not probed), so one reference server, started with ``--protocol-version`` of the
    oldest release of a dialect, answers for every release of it.
    """
    gates = _emulated_gates(version)
    return next(v for v in ALL_VERSIONS if _emulated_gates(v) == gates)


# ---------------------------------------------------------------------------------------------- probes


def _call(url: str, method: str, path: str, body=None, timeout: float = 30) -> requests.Response:
    return requests.request(method, url + path, json=body, timeout=timeout)


def _refused_fields(resp: requests.Response) -> set[str]:
    """The field names a validation error names: SGLang's (``'loc': ('body', ..., 'name'), 'msg'``) or the
    reference server's (``field 'name': ...``)."""
    text = resp.text
    return set(re.findall(r"'loc': \([^\n]*?'(\w+)'\), 'msg'", text)) | set(re.findall(r"field '(\w+)'", text))


def probe(url: str) -> dict:
    """Read the emulated gates' facts off a server's answers (see the module docstring)."""
    call = functools.partial(_call, url)
    facts: dict = {}
    server_info, model_info = call("GET", "/server_info").status_code, call("GET", "/model_info").status_code
    assert (server_info == 404) == (model_info == 404), f"/server_info {server_info} but /model_info {model_info}"
    facts["info_routes"] = server_info != 404
    facts["get_weight_version_route"] = call("GET", "/get_weight_version").status_code == 200
    facts["weight_version_route"] = call("GET", "/weight_version").status_code == 200

    # One mistyped body: the parsing refuses each field the request struct has, and nothing runs.
    r = call("POST", "/update_weights_from_distributed",
             {"names": 5, "load_format": {"bad": 1}, "weight_version": {"bad": 1}})
    assert r.status_code in (400, 422), f"a mistyped update body was not refused: {r.status_code} {r.text[:300]}"
    fields = _refused_fields(r)
    facts["batched_distributed"] = "names" in fields
    facts["flattened_bucket"] = "load_format" in fields

    r = call("POST", "/update_weight_version", {"new_version": PROBE_VERSION})
    if r.status_code == 404:
        route_version = False
    else:
        assert r.status_code == 200, r.text[:300]
        route_version = call("GET", "/get_model_info").json().get("weight_version") == PROBE_VERSION
    assert route_version == ("weight_version" in fields), (
        f"/update_weight_version works: {route_version}, but the update body's weight_version field is "
        f"{'' if 'weight_version' in fields else 'not '}parsed")
    facts["weight_version"] = route_version

    r = call("POST", "/pause_generation", {"mode": "bogus"})
    facts["pause_mode"] = r.status_code in (400, 422)
    if not facts["pause_mode"]:
        assert r.status_code == 200, f"/pause_generation: {r.status_code} {r.text[:300]}"
    assert call("POST", "/continue_generation", {}).status_code == 200

    facts["destroy_group"] = call("POST", "/destroy_weights_update_group",
                                  {"group_name": "wsync-probe-no-such-group"}).status_code != 404

    r = call("POST", "/begin_weight_update", {})
    if r.status_code == 404:
        facts["needs_session"] = False
    else:
        assert r.status_code == 200, r.text[:300]
        assert call("POST", "/end_weight_update", {}).status_code == 200
        # Outside a session (a release before sessions would try to apply this; here none is open). The reference
        # server reads only its own load format on this route, so that one is named (SGLang checks the session first).
        r = call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": "wsync_shm"})
        facts["needs_session"] = r.status_code == 400 and "begin_weight_update" in r.text
    return facts


def _version_lost_when_paused(url: str, model_dir: str) -> bool:
    """An update from disk with a ``weight_version``, sent while paused: is the old version reported afterwards?"""
    call = functools.partial(_call, url)
    assert call("POST", "/pause_generation", {}).status_code == 200
    r = call("POST", "/update_weights_from_disk", {"model_path": model_dir, "weight_version": "wsync-paused"},
             timeout=120)
    assert r.status_code == 200 and r.json()["success"], f"disk update while paused: {r.text[:300]}"
    assert call("POST", "/continue_generation", {}).status_code == 200
    return call("GET", "/get_model_info").json().get("weight_version") != "wsync-paused"


def _client_keeps_paused_version(url: str, model_dir: str) -> bool:
    """The same through :class:`ServerClient`: paused, a disk load with a version, resumed; is it reported?"""
    c = ServerClient(url, timeout=120)
    assert c.model_info()["weight_version"] != CLIENT_VERSION  # else a lost version would read as kept
    c.pause_generation()
    try:
        c.update_weights_from_disk(model_dir, weight_version=CLIENT_VERSION)
    finally:
        c.continue_generation()
    return c.model_info()["weight_version"] == CLIENT_VERSION


def _hold_a_generation(call) -> threading.Thread:
    """Start a generation SGLang's scheduler holds for 6 s, and wait until its running batch has it."""
    gen = threading.Thread(target=lambda: _quiet(lambda: call("POST", "/generate", {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "custom_params": {"harness_hold_s": 6}}},
        timeout=60)), daemon=True)
    gen.start()
    deadline = time.monotonic() + 30
    while call("GET", "/wsync_harness/scheduler").json()["running"] == 0:
        assert time.monotonic() < deadline, "the held generation never reached SGLang's running batch"
        time.sleep(0.1)
    return gen


def _flush_kills(url: str, model_dir: str) -> bool:
    """Paused in place with a generation in flight, an update asks for a flush: does the server die?"""
    call = functools.partial(_call, url)
    _hold_a_generation(call)
    assert call("POST", "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        r = call("POST", "/update_weights_from_disk", {"model_path": model_dir, "flush_cache": True}, timeout=60)
    except requests.ConnectionError:
        return True  # the scheduler's assert ended the server under the request
    if r.status_code == 400 and "not flushed" in r.text:
        call("POST", "/continue_generation", {})
        return False
    raise AssertionError(f"an in-place paused update asking for a flush answered {r.status_code} {r.text[:300]}")


def _retracted_flush_refused(url: str, model_dir: str) -> bool:
    """Paused by ``retract`` with a generation in flight (now in the waiting queue), an update asks for a flush:
    is it refused (the server dies of it where the flush is asserted, or fails the update)?"""
    call = functools.partial(_call, url)
    gen = _hold_a_generation(call)
    assert call("POST", "/pause_generation", {"mode": "retract"}).status_code == 200
    assert call("GET", "/wsync_harness/scheduler").json()["waiting"] == 1, "retract did not re-queue the request"
    try:
        r = call("POST", "/update_weights_from_disk", {"model_path": model_dir, "flush_cache": True}, timeout=60)
    except requests.ConnectionError:
        return True  # the scheduler's assert ended the server under the request
    call("POST", "/continue_generation", {})
    if r.status_code == 400 and "not flushed" in r.text:
        return True
    assert r.status_code == 200 and r.json()["success"], f"a retract-paused flushing update: {r.status_code} {r.text[:300]}"
    gen.join(30)
    return False


def _quiet(fn):
    try:
        fn()
    except Exception:  # the server may die under this request, as it should
        pass


def _kills(version: str, facts: dict) -> bool:
    """Whether the flush probes ended the server: a refused flush kills the releases that assert it."""
    asserts = ProtocolFeatures.from_version(version).flush_asserts
    return bool(facts.get("flush_asserts")) or bool(facts.get("flush_refused_while_retracted") and asserts)


# ---------------------------------------------------------------------------------------------- launches


class _Probes:
    """Launch-and-probe jobs, two at a time, in the order the module's selected tests need them.

    A job's result: ``facts`` (the gates' facts), ``client_kept_version`` (probed only at the releases in
    ``LOSES_PAUSED_VERSION``, else None), ``alive`` (after the probes), and for the reference server the
    ``version`` it reports.
    """

    def __init__(self, order: list[tuple[str, str]], model_dir: str, server_factory) -> None:
        self.order, self.model_dir, self.factory = order, model_dir, server_factory
        self.pool = cf.ThreadPoolExecutor(2, thread_name_prefix="probe")
        self.jobs: dict[tuple[str, str], cf.Future] = {}
        self.lock = threading.Lock()

    def _sglang(self, version: str) -> dict:
        with launch(version, self.model_dir) as srv:
            try:
                facts = probe(srv.url)
                facts["version_lost_when_paused"] = (facts["weight_version"]
                                                     and _version_lost_when_paused(srv.url, self.model_dir))
                # Before the flush probe, which kills the server at the releases whose scheduler asserts the flush.
                kept = _client_keeps_paused_version(srv.url, self.model_dir) if version in LOSES_PAUSED_VERSION else None
                if version in RETRACT_FLUSH_PROBED:
                    facts["flush_refused_while_retracted"] = _retracted_flush_refused(srv.url, self.model_dir)
                if version in FLUSH_PROBED:
                    facts["flush_asserts"] = _flush_kills(srv.url, self.model_dir)
                deadline = time.monotonic() + (10 if _kills(version, facts) else 0)
                while srv.alive() and time.monotonic() < deadline:  # the dying server's exit
                    time.sleep(0.1)
                return {"facts": facts, "client_kept_version": kept, "alive": srv.alive()}
            except Exception as e:
                raise AssertionError(f"probing SGLang {version}'s code failed: {e}\n{srv.log_tail(30)}") from e

    def _reference(self, version: str) -> dict:
        srv = self.factory(extra_args=["--protocol-version", version], ready_timeout=240.0)
        try:
            facts = probe(srv.url)
            kept = _client_keeps_paused_version(srv.url, self.model_dir) if version in LOSES_PAUSED_VERSION else None
            return {"facts": facts, "client_kept_version": kept, "alive": srv.alive(), "version": srv.client.version}
        finally:
            srv.stop()

    def get(self, kind: str, version: str) -> dict:
        key = (kind, version)
        with self.lock:
            i = self.order.index(key) if key in self.order else -1
            for k in [key] + self.order[i + 1:i + 3]:  # this one and the next two
                if k not in self.jobs:
                    fn = self._sglang if k[0] == "sglang" else self._reference
                    self.jobs[k] = self.pool.submit(fn, k[1])
        return self.jobs[key].result(timeout=600)

    def close(self) -> None:
        for f in self.jobs.values():
            f.cancel()
        self.pool.shutdown(wait=True)


def _on_reference(test):
    """Marks a test that also reads the reference server of its release's dialect (for the launch order)."""
    test.on_reference = True
    return test


@pytest.fixture(scope="module")
def probes(request, tiny_model_dir, server_factory):
    order: list[tuple[str, str]] = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if item.module is not request.module or cs is None or not installed(cs.params.get("version", "")):
            continue
        version = cs.params["version"]
        needs = [("sglang", version)]
        if getattr(item.function, "on_reference", False):
            needs.append(("reference", dialect(version)))
        order += [k for k in needs if k not in order]
    p = _Probes(order, tiny_model_dir, server_factory)
    try:
        yield p
    finally:
        p.close()


def _need(version: str) -> None:
    if not installed(version):
        pytest.skip(f"SGLang {version} is not installed (bash scripts/install_sglang.sh {version})")


def _differences(want: dict, got: dict, keys) -> list[str]:
    return [f"{k}: {want[k]} but {got[k]}" for k in keys if k in got and want[k] != got[k]]


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_gates_match_sglang_code(probes, version):
    """Every gate of ProtocolFeatures for ``version`` says what that release's own code does."""
    _need(version)
    seen = probes.get("sglang", version)
    f = ProtocolFeatures.from_version(version)
    table = {k: getattr(f, k) for k in EMULATED + BEHAVIOUR}
    bad = _differences(table, seen["facts"], EMULATED + BEHAVIOUR)
    assert not bad, (f"bridge/protocol.py's gates for {version} disagree with SGLang {version}'s own code "
                     f"(gate but code): {bad}")
    if version in FLUSH_PROBED:
        assert "flush_asserts" in seen["facts"]
    if version in RETRACT_FLUSH_PROBED:
        assert "flush_refused_while_retracted" in seen["facts"]
    assert seen["alive"] is not _kills(version, seen["facts"]), seen


@_on_reference
@pytest.mark.parametrize("version", ALL_VERSIONS)
def test_reference_server_emulates_sglang_code(probes, version):
    """``wsync serve --protocol-version D`` (D: ``version``'s dialect) answers the same probes as SGLang
    ``version``'s own code."""
    _need(version)
    code = probes.get("sglang", version)["facts"]
    ref = probes.get("reference", dialect(version))
    assert ref["version"] == dialect(version) and ref["alive"]
    bad = _differences(code, ref["facts"], EMULATED)
    assert not bad, (f"the reference server at --protocol-version {dialect(version)} differs from SGLang {version}'s "
                     f"own code (code but reference): {bad}")


@_on_reference
@pytest.mark.parametrize("version", LOSES_PAUSED_VERSION)
def test_client_keeps_the_version_of_a_paused_disk_load(probes, version):
    """Issue 21: SGLang ``version``'s own code loses the version of a disk load made while paused; made through
    the client, the load leaves its version reported, there and on the reference server of its dialect (which
    keeps the version anyway: it does not emulate the loss)."""
    _need(version)
    code = probes.get("sglang", version)
    assert code["facts"]["version_lost_when_paused"], f"SGLang {version}'s code kept the version itself"
    assert code["client_kept_version"] is True, f"SGLang {version}: the client's paused disk load lost its version"
    ref = probes.get("reference", dialect(version))
    assert ref["client_kept_version"] is True, (
        f"the reference server at --protocol-version {dialect(version)}: the client's paused disk load lost its version")
