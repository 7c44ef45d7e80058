"""Colocated sync: trainer and server on one host, buckets handed over in /dev/shm files.

A 2-rank FSDP2 trainer (gloo) publishes with ``transport="colocated"`` into a real reference-server
process through ``/update_weights_from_tensor`` with the project's ``load_format="wsync_shm"``. The oracle
is the trainer itself (bit-equal tensors, version, greedy answer), and no shared-memory file may be left.
Bad descriptors must be refused with 400 and change nothing.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import io
import json
import os
import tempfile
import uuid

import pytest
import torch

from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _train_and_publish_colocated(urls: list[str], steps: int):
    from bridge import PublisherConfig, VersionError, WeightPublisher
    from wsync.tasks import make_batch

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(transport="colocated", servers=urls, bucket_mb=0.25, progress=False))
    reports, older = [], None
    try:
        for step in range(1, steps + 1):
            engine.train_batch(make_batch(engine.tokenizer, 8, seed=step * 7 + engine.rank))
            res = pub.publish(engine, version=step)
            reports.append((res.version, res.transport, res.buckets, res.servers, sb.check_served(engine, urls, step)))
        try:
            pub.publish(engine, version=steps - 1)
        except VersionError as e:
            older = str(e)
        if engine.rank == 0:  # the transport lives on rank 0; colocated has no process group
            assert type(pub._transport).__name__ == "ColocatedTransport"
    finally:
        pub.close()
        engine.destroy()
    return reports, older, os.getpid()


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir):
    return server_factory.many([dict(model=tiny_model_dir)])[0]


def test_colocated_sync_after_every_step(server):
    urls = [server.url]
    (reports, older, pid), _ = run_ranks(_train_and_publish_colocated, 2, args=(urls, 2), timeout=240)
    assert [r[0] for r in reports] == [1, 2]
    for version, transport, buckets, servers, checks in reports:
        assert transport == "colocated" and buckets > 1
        assert servers == {server.url: "ok"}
        c = checks[server.url]
        assert c["tensors_equal"], f"v{version}: served tensors differ from the trainer's"
        assert c["version"] == c["generate_version"] == str(version)
        assert c["answer_equal"], f"v{version}: greedy answer differs from the trainer's"
    assert older is not None and "older" in older  # version semantics as for broadcast
    assert server.client.model_info()["weight_version"] == "2"
    assert glob.glob(os.path.join(SHM, f"wsync-{pid}-*")) == []


# ------------------------------------------------------------------ bad input, client in the test process


def _entry(desc) -> str:
    raw = desc if isinstance(desc, bytes) else json.dumps(desc).encode()
    return base64.b64encode(raw).decode()


@pytest.fixture()
def bucket_file(server):
    """A valid one-tensor bucket file (model.norm.weight, served dtype) and its descriptor."""
    from bridge.buckets import plan_buckets
    from bridge.tensors import ParamSpec

    info = server.client.server_info()
    dtype = getattr(torch, info["dtype"])
    shape = (len(server.client.get_weights_by_name("model.norm.weight", 10**6)),)
    spec = ParamSpec("model.norm.weight", shape, dtype)
    bucket = plan_buckets([spec], 1 << 20)[0]
    path = os.path.join(SHM, f"wsync-test-{uuid.uuid4().hex}")
    t = torch.full(shape, 3.0, dtype=dtype)
    with open(path, "wb") as f:
        f.write(t.view(torch.uint8).numpy().tobytes())
    desc = {"path": path, "nbytes": bucket.nbytes, **bucket.request_fields()}
    try:
        yield desc
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _state(server):
    c = server.client
    return c.model_info()["weight_version"], c.weights_checksum()["checksums"]


def _bad_cases(desc, tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * desc["nbytes"])
    return [
        ("not base64 of JSON", base64.b64encode(b"{not json").decode(), "not base64 of a JSON object"),
        ("pickle-looking bytes", _entry(b"\x80\x04\x95"), "not base64 of a JSON object"),
        ("wrong nbytes", _entry({**desc, "nbytes": desc["nbytes"] + 2}), "nbytes"),
        ("missing file", _entry({**desc, "path": desc["path"] + "-gone"}), "cannot open"),
        ("path outside /dev/shm", _entry({**desc, "path": "/etc/passwd"}), "not under"),
        ("missing key", _entry({k: v for k, v in desc.items() if k != "shapes"}), "lacks"),
        ("unknown name", _entry({**desc, "names": ["model.nope"]}), "not a parameter"),
        ("wrong dtype", _entry({**desc, "dtypes": ["int32"], "nbytes": desc["nbytes"] * 2}), "served as"),
    ]


def test_bad_descriptors_are_refused_and_change_nothing(server, bucket_file, tmp_path):
    from bridge.errors import ServerError

    c = server.client
    before = _state(server)
    for what, entry, match in _bad_cases(bucket_file, tmp_path):
        c.begin_weight_update()
        with pytest.raises(ServerError) as ei:
            c.update_weights_from_tensor([entry], load_format="wsync_shm", weight_version="999")
        assert ei.value.status == 400, what
        assert match in ei.value.message, (what, ei.value.message)
        # The refused request aborted the session: ending it applies nothing.
        with pytest.raises(ServerError, match="No weight update session"):
            c.end_weight_update()
        assert _state(server) == before, what


def test_outside_a_session_the_session_error_comes_first(server, bucket_file):
    """SGLang 0.5.23's scheduler checks the session before it looks at the payload: every request outside a
    session, whatever its load format or entry, gets the session error."""
    from bridge.errors import ServerError

    c = server.client
    before = _state(server)
    for load_format, entry in [(None, "bm90IGEgcGlja2xl"), ("direct", _entry(bucket_file)),
                               ("wsync_shm", _entry(bucket_file)), ("flattened_bucket", "%%%")]:
        with pytest.raises(ServerError, match="must run between begin_weight_update") as ei:
            c.update_weights_from_tensor([entry], load_format=load_format)
        assert ei.value.status == 400, load_format
    for group in ("no-such-group", None):  # the distributed route too, before its group and its version label
        with pytest.raises(ServerError) as ei:
            c.update_weights_from_distributed(["model.nope"], ["bfloat16"], [[1]], weight_version="a\nb",
                                              **({"group_name": group} if group else {}))
        assert ei.value.status == 400 and ei.value.message.startswith(
            "Failed to update parameter online: update_weights_from_distributed must run between"), ei.value.message
    c.begin_weight_update()
    with pytest.raises(ServerError, match="load_format 'direct' is not supported") as ei:
        c.update_weights_from_tensor([_entry(bucket_file)], load_format="direct")
    assert ei.value.status == 400
    with pytest.raises(ServerError):
        c.end_weight_update()
    assert _state(server) == before


# ------------------------------------------------------------------ SGLang's own payload: same-host CPU tensors


@contextlib.contextmanager
def _sharing(strategy: str):
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(old)


def _serialize(obj, strategy: str = "file_system") -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: torch's ForkingPickler, base64."""
    from multiprocessing.reduction import ForkingPickler

    with _sharing(strategy):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def test_allowlist_is_sglang_0_5_23s():
    """The unpickler's allowlist is SGLang 0.5.23's ``SafeUnpickler.ALLOWED_GLOBALS``, read from its source."""
    import ast

    from inference_adapter.tensor_payload import SGLANG_ALLOWED_GLOBALS
    from tests.sglang_harness import installed, sglang_dir

    if not installed("0.5.23"):
        pytest.skip("SGLang 0.5.23 is not installed (bash scripts/install_sglang.sh)")
    tree = ast.parse(open(os.path.join(sglang_dir("0.5.23"), "sglang/srt/utils/common.py")).read())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler")
    assign = next(st for st in cls.body if isinstance(st, ast.Assign) and st.targets[0].id == "ALLOWED_GLOBALS")
    assert SGLANG_ALLOWED_GLOBALS == ast.literal_eval(assign.value)


def test_same_host_cpu_tensors_are_staged_and_served(server):
    """SGLang's per-tensor payload (a list of (name, tensor), no load_format) with CPU tensors in shared memory
    (torch's file_system strategy): staged in the session, served at its end, bit for bit."""
    c = server.client
    dtype = getattr(torch, c.server_info()["dtype"])
    n = len(c.get_weights_by_name("model.norm.weight", 10**6))
    sent = {"model.norm.weight": torch.full((n,), 2.5, dtype=dtype).share_memory_()}
    version, before = _state(server)
    c.begin_weight_update()
    c.update_weights_from_tensor([_serialize(list(sent.items()))], weight_version="cpu-shm-1")
    assert _state(server) == (version, before)  # staged, not applied
    c.end_weight_update()
    got_version, after = _state(server)
    assert got_version == "cpu-shm-1"
    assert {k for k in after if after[k] != before[k]} == {"model.norm.weight"}
    assert c.get_weights_by_name("model.norm.weight", 4) == [2.5] * 4


class _Gadget:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_pickles_sglang_refuses_or_this_host_cannot_open_are_refused_by_name(server, tmp_path):
    """A global outside SGLang's allowlist is blocked in SGLang's words before it is looked up (the command in it
    never runs); allowed globals this CPU server cannot serve (a CUDA tensor, torch's file_descriptor handles)
    are refused naming the fix. Each answers 400 with wsync_reason pickle_refused and changes nothing."""
    from torch.multiprocessing import reductions

    from bridge.errors import ServerError
    from bridge.protocol import PICKLE_REFUSED

    marker = tmp_path / "ran"
    t = torch.zeros(4).share_memory_()
    cases = [
        ("os.system", _serialize([("model.norm.weight", _Gadget(os.system, f"touch {marker}"))]),
         f"Blocked unsafe global ({os.system.__module__}.system)"),
        ("CUDA", _serialize([("model.norm.weight", _Gadget(reductions.rebuild_cuda_tensor))]), "CUDA"),
        ("file_descriptor", _serialize([("model.norm.weight", t)], strategy="file_descriptor"),
         "set_sharing_strategy('file_system')"),
        ("not pairs", _serialize({"model.norm.weight": t}), "list of (name, tensor) pairs"),
    ]
    c = server.client
    before = _state(server)
    for what, entry, match in cases:
        c.begin_weight_update()
        with pytest.raises(ServerError) as ei:
            c.update_weights_from_tensor([entry])
        assert (ei.value.status, ei.value.reason) == (400, PICKLE_REFUSED), what
        assert match in ei.value.message, (what, ei.value.message)
        with contextlib.suppress(ServerError):
            c.end_weight_update()
    assert not marker.exists()
    assert _state(server) == before


def test_valid_descriptor_stages_until_end_and_abort_discards(server, bucket_file):
    c = server.client
    before_version, before = _state(server)
    c.begin_weight_update()
    c.update_weights_from_tensor([_entry(bucket_file)], load_format="wsync_shm", weight_version="77")
    assert _state(server) == (before_version, before)  # staged, not applied
    c.abort_weight_update()
    assert _state(server) == (before_version, before)
    c.begin_weight_update()
    c.update_weights_from_tensor([_entry(bucket_file)], load_format="wsync_shm", weight_version="77")
    os.unlink(bucket_file["path"])  # the trainer unlinks once the server answered: the server copied the bytes
    c.end_weight_update()
    version, after = _state(server)
    assert version == "77"
    assert set(n for n in after if after[n] != before[n]) == {"model.norm.weight"}
    assert c.get_weights_by_name("model.norm.weight", 4) == [3.0] * 4


def test_colocated_config_needs_local_servers():
    from bridge import ConfigError, PublisherConfig

    with pytest.raises(ConfigError, match="local"):
        PublisherConfig(transport="colocated", servers=["http://10.1.2.3:30000"])
    with pytest.raises(ConfigError, match="at least one server"):
        PublisherConfig(transport="colocated", servers=[])
    assert PublisherConfig(transport="colocated", servers=["127.0.0.1:30000", "http://localhost:1"]).transport == "colocated"


def test_single_process_versions_retries_and_failed_sync(server, tiny_model_dir):
    """Without torch.distributed: retry, older version, same version with other weights (earlier buckets
    were staged, and must be discarded, not applied), and no shared-memory file left behind."""
    from transformers import AutoModelForCausalLM

    from bridge import PublisherConfig, VersionError, WeightPublisher
    from bridge.digest import tensor_checksum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with WeightPublisher(PublisherConfig(transport="colocated", servers=[server.url], bucket_mb=0.25, progress=False)) as pub:
        r = pub.publish(model, version=200)
        assert (r.version, r.transport, r.servers) == (200, "colocated", {server.url: "ok"}) and r.buckets > 1
        assert pub.publish(model, version=200).retried
        with pytest.raises(VersionError, match="older"):
            pub.publish(model, version=199)
        before = _state(server)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        with pytest.raises(VersionError, match="different weights"):
            pub.publish(model, version=200)
        assert _state(server) == before
        assert not server.client.server_info()["internal_states"][0]["update_session_open"]
        assert pub.publish(model, version=201).servers == {server.url: "ok"}
        assert server.client.model_info()["weight_version"] == "201"
        # ... with the weights of 201 (the ones refused under 200), not only its label.
        want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in model.state_dict().items()}
        assert server.client.weights_checksum()["checksums"] == want, "201 is served with other weights"
    assert glob.glob(os.path.join(SHM, f"wsync-{os.getpid()}-*")) == []
