"""LoRA adapters on the reference server (``--enable-lora``), through the client's calls.

The oracle is PEFT itself: an adapter made and saved by PEFT on the tiny preset, loaded into the server by path
and by tensors, must give PEFT's own greedy answer with that adapter, and the server's adapter tensors must be
bit-equal to what was sent. Refusals answer SGLang's words; a failed load leaves the previous adapter serving;
a swap under 4 client threads generating costs no error and versions only go up. The SGLang-code tier hands the
client's request bodies to SGLang 0.5.23's (and 0.5.8's) own request structs and allowlisted unpickler.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from bridge.digest import tensor_checksum
from bridge.errors import ConfigError, ServerError
from bridge.protocol import ProtocolFeatures

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 3, 77]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16


def _peft_model(seed: int, r: int = 8):
    """The tiny preset (seed 0, bfloat16, as the server serves it) with a PEFT LoRA adapter of random A and B."""
    from peft import LoraConfig, get_peft_model

    from bridge.local.presets import build_model

    base = build_model("tiny", seed=0).to(torch.bfloat16).eval()
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, cfg).eval()
    with torch.no_grad():  # large enough to change the greedy answer of the tiny model
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)
    return model


def _adapter(seed: int, r: int = 8) -> tuple[dict, dict, list[int]]:
    """``(adapter_config, tensors, PEFT's greedy answer)`` of a seeded adapter."""
    from peft import get_peft_model_state_dict

    from tests.fixtures_server import greedy

    model = _peft_model(seed, r)
    config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))
    tensors = {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}
    return config, tensors, greedy(model, PROMPT, 12, ignore_eos=True)


def _save(seed: int, path: str, r: int = 8) -> None:
    _peft_model(seed, r).save_pretrained(path)


def _gen(client, lora: str | None = None) -> dict:
    extra = {"lora_path": lora} if lora is not None else {}
    return client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                             "ignore_eos": True}, **extra)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> str:
    """Where the tests save adapters: the server's --disk-root (adapter directories load only from there)."""
    return str(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lora_server(server_factory, adapter_root):
    return server_factory(extra_args=["--enable-lora", "--max-lora-rank", str(MAX_RANK), "--disk-root", adapter_root],
                          strict_versions=True)


@pytest.fixture(scope="module")
def adapters():
    return {seed: _adapter(seed) for seed in (1, 2, 3, 4)}


def test_adapter_by_path_and_by_tensors_gives_peft_answer(lora_server, adapters, adapter_root):
    from bridge.local.presets import build_model
    from tests.fixtures_server import greedy

    c = lora_server.client
    a1 = os.path.join(adapter_root, "a1")
    _save(1, a1)
    out = c.load_adapter_from_path("by-path", a1, version="7")
    assert out["success"] and out["loaded_adapters"]["by-path"] == a1, out
    cfg2, t2, want2 = adapters[2]
    out = c.load_adapter_from_tensors("by-tensors", cfg2, t2, version="3",
                                      checksums={n: tensor_checksum(t) for n, t in t2.items()})
    assert out["success"] and out["loaded_adapters"]["by-tensors"] == "__tensor__", out

    r1, r2, base = _gen(c, "by-path"), _gen(c, "by-tensors"), _gen(c)
    assert r1["output_ids"] == adapters[1][2] and r1["meta_info"]["wsync_lora_version"] == "7"
    assert r2["output_ids"] == want2 and r2["meta_info"]["wsync_lora_version"] == "3"
    assert "wsync_lora_version" not in base["meta_info"]
    assert base["output_ids"] == greedy(build_model("tiny", seed=0).to(torch.bfloat16).eval(), PROMPT, 12,
                                       ignore_eos=True)
    assert len({tuple(r1["output_ids"]), tuple(r2["output_ids"]), tuple(base["output_ids"])}) == 3, \
        "the adapters must change the answer, or the comparison proves nothing"
    served = c.adapter_checksums("by-tensors")
    assert served["checksums"] == {n: tensor_checksum(t) for n, t in t2.items()}
    assert served["wsync_lora_version"] == "3"
    ids = [m["id"] for m in c._http.call("GET", "/v1/models")["data"]]
    assert {"by-path", "by-tensors"} <= set(ids)
    # several adapters in one batch: each prompt runs with its own
    batch = c.generate(input_ids=[PROMPT, PROMPT, PROMPT], lora_path=["by-path", None, "by-tensors"],
                       sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert [b["output_ids"] for b in batch] == [r1["output_ids"], base["output_ids"], r2["output_ids"]]
    for name in ("by-path", "by-tensors"):
        c.unload_adapter(name)


def test_openai_routes_take_the_adapter_as_sglang_does(lora_server, adapters):
    """``model: "<served>:<adapter>"`` (or ``lora_path``) picks the adapter on /v1/completions and
    /v1/chat/completions, streamed or not, as SGLang's ``_resolve_lora_path``; the answer is /generate's."""
    import requests

    c = lora_server.client
    c.load_adapter_from_tensors("oa", *adapters[2][:2], version="9")
    want = _gen(c, "oa")["text"]
    served = c.model_info()["served_model_name"]
    common = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for extra in ({"model": f"{served}:oa"}, {"model": "anything:oa"}, {"model": served, "lora_path": "oa"}):
        r = requests.post(lora_server.url + "/v1/completions", json={**common, **extra}, timeout=60).json()
        assert r["choices"][0]["text"] == want, (extra, r)
        assert r["metadata"]["wsync_lora_version"] == "9"
    chunks = requests.post(lora_server.url + "/v1/completions", json={**common, "model": f"{served}:oa",
                                                                      "stream": True}, timeout=60).text
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in chunks.splitlines()
             if line.startswith("data: {")]
    assert "".join(texts) == want
    r = requests.post(lora_server.url + "/v1/completions", json={**common, "model": f"{served}:nope"}, timeout=60)
    assert r.status_code == 400 and "not loaded: nope" in r.json()["message"]
    c.unload_adapter("oa")


def test_refusals_say_what_sglang_says_and_a_failed_load_changes_nothing(lora_server, server_factory, adapters,
                                                                         adapter_root, tmp_path):
    c = lora_server.client
    cfg, t, want = adapters[1]
    c.load_adapter_from_tensors("kept", cfg, t, version="1")
    with pytest.raises(ServerError, match="The following requested LoRA adapters are not loaded: nope"):
        _gen(c, "nope")
    with pytest.raises(ServerError, match="LoRA with name nope does not exist"):
        c.unload_adapter("nope")
    with pytest.raises(ServerError, match="Failed to load LoRA adapter kept because it is already loaded"):
        c.load_adapter_from_tensors("kept", *adapters[2][:2], version="2")
    big_cfg, big_t, _ = _adapter(9, r=32)
    with pytest.raises(ServerError, match=r"with rank 32 is incompatible .* `--max-lora-rank` \(16\)"):
        c.load_adapter_from_tensors("kept", big_cfg, big_t, version="2", replace=True)
    nan = {n: (torch.full_like(x, float("nan")) if i == 0 else x) for i, (n, x) in enumerate(adapters[2][1].items())}
    with pytest.raises(ServerError, match="holds NaN or Inf"):
        c.load_adapter_from_tensors("kept", adapters[2][0], nan, version="2", replace=True)
    with pytest.raises(ServerError, match="no adapter_config.json"):
        c.load_adapter_from_path("kept", adapter_root, version="2", replace=True)
    _save(2, str(tmp_path / "outside"))
    with pytest.raises(ServerError, match="is outside the directories this server loads from"):
        c.load_adapter_from_path("kept", str(tmp_path / "outside"), version="2", replace=True)
    with pytest.raises(ServerError, match=r"\[LORA-CHECK\] rank0 adapter sync MISMATCH"):
        c.load_adapter_from_tensors("kept", *adapters[2][:2], version="2", replace=True,
                                    checksums={n: "0" * 64 for n in adapters[2][1]})
    with pytest.raises(ServerError, match=r"\[LORA-CHECK\] rank0 adapter sync MISMATCH"):  # checked before the tensors
        c.load_adapter_from_tensors("kept", adapters[2][0], nan, version="2", replace=True,
                                    checksums={n: "0" * 64 for n in adapters[2][1]})
    unknown = {k.replace("q_proj", "no_such_proj"): x for k, x in adapters[2][1].items()}
    with pytest.raises(ServerError, match="is not a Linear module of the served model"):
        c.load_adapter_from_tensors("kept", adapters[2][0], unknown, version="2", replace=True)
    r = _gen(c, "kept")  # every refusal left the adapter as it was
    assert r["output_ids"] == want and r["meta_info"]["wsync_lora_version"] == "1"
    assert c.adapter_checksums("kept")["checksums"] == {n: tensor_checksum(x) for n, x in t.items()}
    c.unload_adapter("kept")

    plain = server_factory()  # no --enable-lora
    for call in (lambda: plain.client.load_adapter_from_tensors("x", cfg, t),
                 lambda: plain.client.load_adapter_from_path("x", str(tmp_path)),
                 lambda: plain.client.unload_adapter("x"), lambda: _gen(plain.client, "x")):
        with pytest.raises(ServerError, match="LoRA is not enabled. Please set `--enable-lora` to enable LoRA."):
            call()


def _in_one_buffer(tensors: dict[str, torch.Tensor], gap: int = 0, order=None) -> tuple[torch.Tensor, dict]:
    """``tensors`` as views of one flat buffer, as the trainer's gather sends them (laid out in ``order``, the
    dict's by default), with ``gap`` NaN elements before each: ``(buffer, {name: view})``."""
    names = list(order or tensors)
    dtype = next(iter(tensors.values())).dtype
    flat = torch.full((sum(tensors[n].numel() + gap for n in names),), float("nan"), dtype=dtype)
    views, off = {}, 0
    for n in names:
        off += gap
        views[n] = flat[off : off + tensors[n].numel()].view(tensors[n].shape)
        views[n].copy_(tensors[n])
        off += tensors[n].numel()
    return flat, {n: views[n] for n in tensors}


def test_an_adapter_in_one_buffer_is_copied_and_checked_in_one_pass(lora_server, adapters, adapter_root):
    """The trainer sends its adapter as views of one flat buffer: the server copies and checks it as one, yet a NaN
    or Inf anywhere in it is refused naming its tensor, bytes between the tensors are not the adapter's, and what
    is served is the server's own copy, equal to what was sent."""
    c = lora_server.client
    cfg, t, want = adapters[3]
    names = list(t)
    flat, views = _in_one_buffer(t, order=names[::-1])  # in any order
    sent = {n: tensor_checksum(x) for n, x in t.items()}
    c.load_adapter_from_tensors("one-buffer", cfg, views, version="1", checksums=sent)
    assert _gen(c, "one-buffer")["output_ids"] == want
    assert c.adapter_checksums("one-buffer")["checksums"] == sent
    flat.zero_()  # the sender's buffer after the answer: the server serves its own copy
    assert c.adapter_checksums("one-buffer")["checksums"] == sent
    assert _gen(c, "one-buffer")["output_ids"] == want
    for i, (which, where, value) in enumerate([(0, 0, float("nan")), (len(names) // 2 + 1, 5, float("inf")),
                                               (len(names) - 1, -1, -float("inf"))]):
        flat, views = _in_one_buffer(t)
        views[names[which]].view(-1)[where] = value
        module, part = names[which].removeprefix("base_model.model.").rsplit(".", 1)[0].rsplit(".", 1)
        with pytest.raises(ServerError, match=rf"{module}\.{part} holds NaN or Inf"):
            c.load_adapter_from_tensors("one-buffer", cfg, views, version=str(2 + i), replace=True)
    flat, views = _in_one_buffer(t, gap=3)  # NaN between the tensors, none in them
    c.load_adapter_from_tensors("one-buffer", cfg, views, version="5", replace=True)
    assert c.adapter_checksums("one-buffer")["checksums"] == sent
    assert _gen(c, "one-buffer")["output_ids"] == want
    c.unload_adapter("one-buffer")

    # By a directory: the file's tensors are read as views of its bytes, checked in one pass, yet named when bad
    from safetensors.torch import save_file

    from bridge.snapshot.adapter import write_adapter_dir

    folder = os.path.join(adapter_root, "one-file")
    path = write_adapter_dir(folder, 1, t, cfg)
    c.load_adapter_from_path("one-file", path, version="1")
    assert c.adapter_checksums("one-file")["checksums"] == sent and _gen(c, "one-file")["output_ids"] == want
    bad = {n: x.clone() for n, x in t.items()}
    bad[names[7]].view(-1)[3] = float("nan")
    module, part = names[7].removeprefix("base_model.model.").rsplit(".", 1)[0].rsplit(".", 1)
    with pytest.raises(ServerError, match=rf"{module}\.{part} holds NaN or Inf"):
        c.load_adapter_from_path("one-file", write_adapter_dir(folder, 2, bad, cfg), version="2", replace=True)
    odd = dict(t)
    odd[names[0]] = t[names[0]].to(torch.int32)  # not a plain float file: safetensors' own loader reads it
    save_file(odd, os.path.join(write_adapter_dir(folder, 3, t, cfg), "adapter_model.safetensors"))
    with pytest.raises(ServerError, match="send 2-D float32, bfloat16 or float16 tensors"):
        c.load_adapter_from_path("one-file", os.path.join(folder, "v3"), version="3", replace=True)
    assert c.adapter_checksums("one-file")["checksums"] == sent
    c.unload_adapter("one-file")

    from inference_adapter.tensor_payload import copied

    big = torch.zeros(1 << 20)  # two small views at the ends of a large buffer: only their own bytes are copied
    out = copied([("a", big[:4]), ("b", big[-4:])])
    assert [x.untyped_storage().nbytes() for x in out.values()] == [16, 16]


def test_older_version_and_another_writer_are_refused(lora_server, adapters):
    """The weights' rules hold for adapters: a replacement older than the served version of that name is refused
    unless it starts a new run, and while another writer holds the server's lease nothing changes."""
    from bridge.client import ServerClient
    from bridge.errors import VersionError
    from bridge.protocol import ANOTHER_WRITER

    c = lora_server.client
    c.load_adapter_from_tensors("ruled", *adapters[1][:2], version="5")
    with pytest.raises(VersionError, match="wsync_lora_version 4 is older than the served version 5"):
        c.load_adapter_from_tensors("ruled", *adapters[2][:2], version="4", replace=True)
    c.load_adapter_from_tensors("ruled", *adapters[2][:2], version="4", replace=True, rollback=True)  # an undo may
    assert _gen(c, "ruled")["meta_info"]["wsync_lora_version"] == "4"
    other = ServerClient(lora_server.url)
    other.name_writer("other-writer")
    other.take_writer_lease(60)
    try:
        for call in (lambda: c.load_adapter_from_tensors("ruled", *adapters[2][:2], version="6", replace=True),
                     lambda: c.unload_adapter("ruled")):
            with pytest.raises(ServerError, match="another writer holds this server") as ei:
                call()
            assert ei.value.status == 409 and ei.value.reason == ANOTHER_WRITER
        other.load_adapter_from_tensors("ruled", *adapters[2][:2], version="6", replace=True)  # the holder may
    finally:
        other.release_writer_lease()
    assert _gen(c, "ruled")["meta_info"]["wsync_lora_version"] == "6"
    restarted = ServerClient(lora_server.url)
    restarted.claim_run("another-run")
    restarted.load_adapter_from_tensors("ruled", *adapters[1][:2], version="1", replace=True)  # a new run may go back
    r = _gen(c, "ruled")
    assert r["meta_info"]["wsync_lora_version"] == "1" and r["output_ids"] == adapters[1][2]
    c.unload_adapter("ruled")


def test_swap_under_four_generating_threads(lora_server, adapters, adapter_root):
    """Replacing the adapter while 4 threads generate with it: no error, each answer is exactly the answer of the
    version it reports (never half of one), and each thread sees versions only go up."""
    c = lora_server.client
    want = {str(v): adapters[v][2] for v in adapters}
    c.load_adapter_from_tensors("live", *adapters[1][:2], version="1")
    stop, seen, errors = threading.Event(), [[] for _ in range(4)], []

    def client_thread(i: int) -> None:
        while not stop.is_set():
            try:
                r = _gen(c, "live")
            except Exception as e:  # every error is the failure under test
                errors.append(repr(e))
                return
            seen[i].append((r["meta_info"]["wsync_lora_version"], r["output_ids"]))

    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client_thread, i) for i in range(4)]
        for v in (2, 3, 4):
            _wait_for(lambda: all(len(s) >= 1 for s in seen) or errors, 60)
            if v == 3:
                _save(3, os.path.join(adapter_root, "v3"))
                c.load_adapter_from_path("live", os.path.join(adapter_root, "v3"), version=str(v), replace=True)
            else:
                c.load_adapter_from_tensors("live", *adapters[v][:2], version=str(v), replace=True)
            counts = [len(s) for s in seen]
            _wait_for(lambda counts=counts: all(len(s) > k for s, k in zip(seen, counts)) or errors, 60)
        stop.set()
        for f in futs:
            f.result()
    assert not errors, errors[:3]
    for s in seen:
        versions = [int(v) for v, _ in s]
        assert versions == sorted(versions), versions
        assert all(out == want[v] for v, out in s)
    assert max(int(v) for s in seen for v, _ in s) == 4
    c.unload_adapter("live")


def _wait_for(cond, bound_s: float) -> None:
    """Poll ``cond`` until true; ``bound_s``: a few generations of the tiny model, with ample slack on 2 cores."""
    import time

    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached within {bound_s} s"
        time.sleep(0.02)


def test_lora_paths_serve_adapters_from_the_start(server_factory, adapters, adapter_root):
    """SGLang's ``--lora-paths`` (``NAME=DIR``, ``DIR``, JSON) load at start, without --enable-lora."""
    boot = os.path.join(adapter_root, "boot")
    _save(3, boot)
    s = server_factory(extra_args=["--lora-paths", f"first={boot}", json.dumps({"lora_name": "second",
                                                                                "lora_path": boot})])
    for name in ("first", "second"):
        r = _gen(s.client, name)
        assert r["output_ids"] == adapters[3][2] and r["meta_info"]["wsync_lora_version"] == "default"


def test_older_dialects_choose_the_body(server_factory, adapters):
    """0.5.8 takes one string ``serialized_tensors``; 0.5.7 has no route, refused before anything is sent."""
    old = server_factory(extra_args=["--enable-lora", "--protocol-version", "0.5.8"])
    cfg, t, want = adapters[1]
    old.client.load_adapter_from_tensors("a", cfg, t, version="1")
    assert _gen(old.client, "a")["output_ids"] == want
    from bridge.client.lora import tensors_body

    body, _ = tensors_body(ProtocolFeatures.from_version("0.5.8"), 1, "a", cfg, t)
    assert isinstance(body["serialized_tensors"], str) and "serialized_named_tensors" not in body
    with pytest.raises(ConfigError, match="needs >= 0.5.8"):
        tensors_body(ProtocolFeatures.from_version("0.5.7"), 1, "a", cfg, t)


# ------------------------------------------------------------------ SGLang's own structs and unpickler


@pytest.mark.sglang_code
@pytest.mark.parametrize("version", ["0.5.8"])  # 0.5.23's whole server takes them in tests/test_real_sglang.py
def test_client_bodies_pass_sglang_own_structs_and_unpickler(version, adapters, tmp_path):
    from bridge.client.lora import tensors_body
    from tests.sglang_harness import installed, sglang_dir

    assert installed(version), f"SGLang {version} is not installed: run scripts/install_sglang.sh"
    cfg, t, _ = adapters[1]
    body, held = tensors_body(ProtocolFeatures.from_version(version), 1, "a", cfg, t,
                              checksums={n: tensor_checksum(x) for n, x in t.items()})
    bodies = {"from_tensors": {**body, "wsync_lora_version": "1", "wsync_replace": True},
              "from_path": {"lora_name": "a", "lora_path": "/x", "pinned": False, "wsync_lora_version": "1"},
              "unload": {"lora_name": "a"}}
    path = tmp_path / "bodies.json"
    path.write_text(json.dumps(bodies))
    rc = subprocess.run([sys.executable, "-m", "tests.sglang_harness.lora_bodies", "--sglang-dir",
                         sglang_dir(version), "--bodies", str(path)], capture_output=True, text=True, timeout=300,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        env=dict(os.environ, OMP_NUM_THREADS="1"))
    held.close()
    assert rc.returncode == 0, rc.stderr[-3000:]
    got = json.loads(rc.stdout.strip().splitlines()[-1])
    assert got["checksums"] == {n: tensor_checksum(x) for n, x in t.items()}
    assert got["lora_name"] == "a" and got["config_dict"] == cfg


def test_bad_bodies_are_refused_and_change_nothing(lora_server, adapters, adapter_root):
    """Wrong types, encodings, payloads and files on every LoRA route: a 4xx naming what was wrong, never a 5xx,
    and the adapter served before still serving, bit for bit."""
    import base64
    import pickle

    import requests

    c = lora_server.client
    cfg, t, want = adapters[1]
    c.load_adapter_from_tensors("steady", cfg, t, version="1")
    bad_dir = os.path.join(adapter_root, "bad")
    os.makedirs(os.path.join(bad_dir, "adapter_config.json"), exist_ok=True)  # a directory where a file belongs
    fifo_dir = os.path.join(adapter_root, "fifo")
    os.makedirs(fifo_dir, exist_ok=True)
    with open(os.path.join(fifo_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    if not os.path.exists(os.path.join(fifo_dir, "adapter_model.safetensors")):
        os.mkfifo(os.path.join(fifo_dir, "adapter_model.safetensors"))  # would block a reader that waits on it
    evil = base64.b64encode(pickle.dumps(os.getcwd)).decode()
    from bridge.client.lora import tensors_body

    good, held = tensors_body(ProtocolFeatures.from_version("0.5.23"), 1, "steady", cfg, t)
    entry = good["serialized_named_tensors"]
    tb = {"lora_name": "steady", "config_dict": cfg, "wsync_replace": True}
    cases = [
        ("/load_lora_adapter", b"{"), ("/load_lora_adapter", b"[]"), ("/load_lora_adapter", {"lora_name": 1}),
        ("/load_lora_adapter", {"lora_name": "steady", "lora_path": 5}),
        ("/load_lora_adapter", {"lora_name": "steady", "lora_path": "a\x00b", "wsync_replace": True}),
        ("/load_lora_adapter", {"lora_name": "steady", "lora_path": bad_dir, "wsync_replace": True}),
        ("/load_lora_adapter", {"lora_name": "steady", "lora_path": fifo_dir, "wsync_replace": True}),
        ("/load_lora_adapter", {"lora_name": "steady", "lora_path": "/", "wsync_replace": "yes"}),
        ("/load_lora_adapter_from_tensors", {**tb, "serialized_named_tensors": ["not base64!"]}),
        ("/load_lora_adapter_from_tensors", {**tb, "serialized_named_tensors": [base64.b64encode(b"junk").decode()]}),
        ("/load_lora_adapter_from_tensors", {**tb, "serialized_named_tensors": [evil]}),
        ("/load_lora_adapter_from_tensors", {**tb, "serialized_named_tensors": []}),
        ("/load_lora_adapter_from_tensors", {**tb, "serialized_named_tensors": "abc"}),
        ("/load_lora_adapter_from_tensors", {**tb, "config_dict": {**cfg, "r": "x"}, "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "config_dict": {**cfg, "lora_alpha": "x"},
                                             "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "config_dict": {**cfg, "target_modules": 5},
                                             "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "config_dict": {**cfg, "use_dora": True},
                                             "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "config_dict": [], "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "load_format": "direct", "serialized_named_tensors": [evil]}),
        ("/load_lora_adapter_from_tensors", {**tb, "wsync_lora_version": {"a": 1}, "serialized_named_tensors": [evil]}),
        ("/load_lora_adapter_from_tensors", {**tb, "lora_name": "", "serialized_named_tensors": entry}),
        ("/load_lora_adapter_from_tensors", {**tb, "wsync_lora_version": "a\nb", "serialized_named_tensors": entry}),
        ("/unload_lora_adapter", {"lora_name": None}), ("/unload_lora_adapter", b"\xff"),
        ("/wsync/lora_checksum", {"lora_name": "nope"}), ("/wsync/lora_checksum", {}),
        ("/generate", {"input_ids": PROMPT, "lora_path": 5}),
        ("/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": ["steady"]}),
    ]
    problems = []
    for route, body in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = requests.post(lora_server.url + route, data=data, headers={"Content-Type": "application/json"}, timeout=60)
        if not 400 <= r.status_code < 500:
            problems.append(f"{route} {body!r:.120}: HTTP {r.status_code} {r.text[:200]}")
    held.close()
    assert not problems, "\n".join(problems)
    r = _gen(c, "steady")
    assert r["output_ids"] == want and r["meta_info"]["wsync_lora_version"] == "1"
    assert c.adapter_checksums("steady")["checksums"] == {n: tensor_checksum(x) for n, x in t.items()}
    c.unload_adapter("steady")


@pytest.mark.sglang_code
def test_lora_gates_are_each_installed_releases():
    """``ProtocolFeatures.lora_from_tensors`` and ``lora_tensors_per_rank`` say what each installed release's own
    source has: the route in its ``http_server.py``, the field in its ``LoadLoRAAdapterFromTensorsReqInput``."""
    import ast

    from tests.sglang_harness import ALL_VERSIONS, installed, sglang_dir

    seen = {}
    for v in ALL_VERSIONS:
        assert installed(v), f"SGLang {v} is not installed: run scripts/install_sglang.sh"
        src = os.path.join(sglang_dir(v), "sglang", "srt")
        with open(os.path.join(src, "entrypoints", "http_server.py")) as f:
            route = '"/load_lora_adapter_from_tensors"' in f.read()
        with open(os.path.join(src, "managers", "io_struct.py")) as f:
            tree = ast.parse(f.read())
        fields = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "LoadLoRAAdapterFromTensorsReqInput":
                fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        f = ProtocolFeatures.from_version(v)
        seen[v] = (route, "serialized_named_tensors" in fields)
        assert seen[v] == (f.lora_from_tensors, f.lora_from_tensors and f.lora_tensors_per_rank), (v, seen[v], fields)
        assert not route or {"serialized_named_tensors", "serialized_tensors"} & fields
    assert seen["0.5.8"] == (True, False) and seen["0.5.23"] == (True, True) and seen["0.5.7"] == (False, False)


# ------------------------------------------------------------------ over a weight-update group (the project route)

def _over_group(trainer, client, name: str, cfg: dict, tensors: dict, *, version: str, checksums=None,
                broadcast: bool = True, before_broadcast=None) -> dict:
    """``/wsync/load_lora_adapter_from_distributed`` of ``tensors`` and one broadcast of their flat buffer from
    ``trainer`` (group rank 0 in this process); ``before_broadcast()`` runs while the server waits for it."""
    import datetime
    import time

    import torch.distributed as dist

    from bridge.lora.broadcast import flat_layout

    bucket, buf = flat_layout(tensors, None)
    f = trainer.pool.submit(client.load_adapter_from_distributed, name, cfg, names=[s.name for s in bucket.specs],
                            dtypes=[s.dtype for s in bucket.specs], shapes=[list(s.shape) for s in bucket.specs],
                            group_name=trainer.group_name, version=version, replace=True, checksums=checksums,
                            timeout=trainer.timeout + 10)
    if before_broadcast is not None:
        deadline = time.monotonic() + trainer.timeout  # the server's receive waits at most --receive-timeout
        while client.server_info()["internal_states"][0]["receiving_on_group"] != trainer.group_name:
            assert not f.done(), f.result()
            assert time.monotonic() < deadline, "the server never waited for the broadcast"
            time.sleep(0.02)
        before_broadcast()
    if broadcast:
        work = dist.broadcast(buf, src=0, group=trainer.pg, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=trainer.timeout))
        except RuntimeError:  # the server dropped the group without receiving: its answer says why
            pass
    return f.result(timeout=trainer.timeout + 20)


def test_an_adapter_over_a_weight_update_group(lora_server, server_factory, adapters):
    """The reference server's ``/wsync/load_lora_adapter_from_distributed``: the broadcast adapter gives PEFT's
    answer, bit-equal, and generation goes on while the server waits for the broadcast. Refused after the receive
    (the group stays usable), in SGLang's words: a checksum mismatch, a rank over ``--max-lora-rank``. Refused before
    it, the group destroyed: an announcement that describes no buffer, LoRA not enabled. A broadcast that never
    comes ends by the receive bound. Every refusal leaves the previous adapter serving."""
    from tests.fixtures_server import Trainer

    c = lora_server.client
    (cfg1, t1, want1), (cfg2, t2, want2) = adapters[1], adapters[2]

    def sums(t):
        return {n: tensor_checksum(x) for n, x in t.items()}

    def serves(client, version, want, t):
        r = _gen(client, "bc")
        assert r["output_ids"] == want and r["meta_info"]["wsync_lora_version"] == version
        assert client.adapter_checksums("bc")["checksums"] == sums(t)

    with Trainer([c]) as tr:
        out = _over_group(tr, c, "bc", cfg1, t1, version="1", checksums=sums(t1))
        assert out["loaded_adapters"]["bc"] == "__distributed__" and out["wsync_lora_version"] == "1", out
        serves(c, "1", want1, t1)
        with pytest.raises(ServerError, match=r"\[LORA-CHECK\] rank0 adapter sync MISMATCH of 28 expected: 28 value-diff"):
            _over_group(tr, c, "bc", cfg2, t2, version="2", checksums={n: "0" * 64 for n in t2})
        big_cfg, big_t, _ = _adapter(9, r=32)
        with pytest.raises(ServerError, match=r"with rank 32 is incompatible .* `--max-lora-rank` \(16\)"):
            _over_group(tr, c, "bc", big_cfg, big_t, version="2")
        serves(c, "1", want1, t1)
        # the group is still usable; a generation answers while the server waits for the broadcast
        _over_group(tr, c, "bc", cfg2, t2, version="2", checksums=sums(t2),
                    before_broadcast=lambda: serves(c, "1", want1, t1))
        serves(c, "2", want2, t2)
        names = list(t1)
        with pytest.raises(ServerError, match=r"dtype 'float99', which is not a torch dtype name.*was not received, "
                                              r"so group wsync-test-\S+ was destroyed"):
            c.load_adapter_from_distributed("bc", cfg1, names=names, dtypes=["float99"] * len(names),
                                            shapes=[list(t1[n].shape) for n in names], group_name=tr.group_name,
                                            version="3", replace=True)
        with pytest.raises(ServerError, match=r"Group wsync-test-\S+ not in \[\] \(the server destroyed it because it "
                                              r"was sent an adapter it could not receive\)"):
            _over_group(tr, c, "bc", cfg1, t1, version="3", broadcast=False)
        serves(c, "2", want2, t2)
    c.unload_adapter("bc")

    # --group-timeout 3: a group dropped while a receive waits on it is destroyed once that receive ends (gloo)
    quick, plain = server_factory.many([{"extra_args": ["--enable-lora", "--receive-timeout", "1", "--group-timeout", "3"]}, {}])
    with Trainer([quick.client]) as tr:
        _over_group(tr, quick.client, "bc", cfg1, t1, version="1")
        with pytest.raises(ServerError, match=r"broadcast on group \S+ failed .*did not arrive within .* The group was "
                                              "destroyed; call init_weights_update_group again. The served adapter is "
                                              "unchanged"):
            _over_group(tr, quick.client, "bc", cfg2, t2, version="2", broadcast=False)
        serves(quick.client, "1", want1, t1)
    with Trainer([plain.client]) as tr:
        with pytest.raises(ServerError, match=r"LoRA is not enabled. Please set `--enable-lora` to enable LoRA. The "
                                              r"trainer's broadcast was not received, so group \S+ was destroyed"):
            _over_group(tr, plain.client, "bc", cfg1, t1, version="1")
