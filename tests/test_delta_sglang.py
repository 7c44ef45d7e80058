"""The delta encoding into SGLang 0.5.23's own code (the ``sglang_code`` tier), with the project's loader.

The harness (:mod:`tests.sglang_harness.serve`) is started as SGLang is started for deltas, with
``--custom-weight-loader bridge.serving.sglang_delta_loader.load_delta``: SGLang's ``WeightUpdater`` gets it in
its ``custom_weight_loaders``, its ``SafeUnpickler`` reads the payload, and the loader applies each delta
through what SGLang's own Qwen2 ``load_weights`` does (q/k/v stacked into ``qkv_proj``, gate/up into
``gate_up_proj``). Served tensors are compared in SGLang's layout with the trainer's own (see
:func:`tests.sglang_harness.serve.sglang_layout`). TP slices: SGLang's parallel linear layers built for 2 TP
ranks, in a process of SGLang's code (``_tp_check``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from bridge.encodings.delta_send import LOADER
from tests.dist_utils import run_ranks
from tests.sglang_harness import ROOT, installed, launch, sglang_dir

pytestmark = pytest.mark.sglang_code


def _need() -> None:
    if not installed("0.5.23"):
        pytest.skip("SGLang 0.5.23 is not installed (bash scripts/install_sglang.sh)")


def _served_rows(url: str, publishes: int, harness_url: str):
    """Every rank: ``publishes`` publishes with a training step before each; rank 0 compares, after each, every
    tensor SGLang serves with the trainer's own (bf16, SGLang's layout)."""
    import requests
    import torch

    from bridge.digest import tensor_checksum
    from tests import sync_bodies as sb
    from tests.sglang_harness.serve import sglang_layout
    from tests.test_delta import _engine, _publisher, without_cost_model

    without_cost_model()  # the loader's path is the point, every sync after the first a delta
    engine = _engine(1e-5)
    pub = _publisher("broadcast", [url])
    rows = []
    try:
        for v in range(1, publishes + 1):
            sb.train_step(engine, v)
            res = pub.publish(engine, version=v)
            full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective
            if engine.rank == 0:
                want = {n: tensor_checksum(t) for n, t in sglang_layout({n: t.to(torch.bfloat16) for n, t in full.items()}).items()}
                got = requests.get(harness_url + "/wsync_harness/weights", timeout=30).json()
                bad = [n for n, c in want.items() if n in got["checksums"] and got["checksums"][n] != c]
                rows.append(dict(version=v, encoding=res.encoding, reason=res.anchor_reason, bytes=res.bytes, bad=bad,
                                 served_version=got["weight_version"], unmatched=sorted(set(want) ^ set(got["checksums"]))))
    finally:
        pub.close()
        engine.destroy()
    return rows


def test_sglang_that_does_not_require_zstandard_gets_deltas_without_the_zstd_stage(tiny_model_dir, tmp_path):
    """SGLang requires the zstandard package from 0.5.20 on; before, its environment may lack it, and a zstd record
    there would end the scheduler (the loader cannot answer an error). Into SGLang 0.5.8's code with the loader
    and zstandard not importable in its process: every delta goes without the zstd stage, bit-exact, and the
    server lives."""
    import os

    if not installed("0.5.8"):
        pytest.skip("SGLang 0.5.8 is not installed (bash scripts/install_sglang.sh)")
    stub = tmp_path / "no_zstd" / "zstandard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('zstandard: not installed in this environment (the test)')\n")
    path = os.pathsep.join([str(stub.parent), ROOT, os.environ.get("PYTHONPATH", "")])
    with launch("0.5.8", tiny_model_dir, custom_weight_loader=LOADER, env={"PYTHONPATH": path}) as srv:
        rows, _ = run_ranks(_served_rows, 2, args=(srv.url, 6, srv.url), timeout=600)
        assert srv.alive(), srv.log_tail()
    assert [r["encoding"] for r in rows] == ["anchor"] + ["delta"] * 5, rows
    for r in rows:
        assert not r["bad"] and r["served_version"] == str(r["version"]) and not r["unmatched"], r


def test_sglang_without_the_loader_gets_anchors(tiny_model_dir):
    _need()
    with launch("0.5.23", tiny_model_dir) as srv:
        rows, _ = run_ranks(_served_rows, 2, args=(srv.url, 2, srv.url), timeout=600)
    assert [r["encoding"] for r in rows] == ["anchor", "anchor"], rows
    assert "--custom-weight-loader " + LOADER in rows[1]["reason"], rows[1]
    assert not any(r["bad"] for r in rows), rows


_TP_CHECK = r'''
import json, sys, types
sys.path.insert(0, ROOT)
from tests.sglang_harness.bootstrap import setup
setup(SGLANG_DIR)
import torch, torch.distributed as dist
from bridge.process_group import find_free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
import sglang.srt.layers.linear as linear
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from bridge.codecs.delta import DELTA_TENSOR, encode_sparse, write_record
from bridge.serving.sglang_delta_loader import load_delta

H, HEADS, KV, HD, INTER = 64, 4, 2, 16, 96

def model(tp_rank):
    linear.get_parallel = lambda: types.SimpleNamespace(tp_group=None, tp_size=2, tp_rank=tp_rank)
    m = object.__new__(Qwen2ForCausalLM); torch.nn.Module.__init__(m)
    m.config = types.SimpleNamespace(tie_word_embeddings=False); m.quant_config = None
    m.pp_group = types.SimpleNamespace(is_last_rank=True)
    inner = torch.nn.Module(); inner.layers = torch.nn.ModuleList()
    layer, attn, mlp = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    attn.qkv_proj = QKVParallelLinear(H, HD, HEADS, KV, bias=True, params_dtype=torch.bfloat16)
    attn.o_proj = RowParallelLinear(HEADS * HD, H, bias=False, params_dtype=torch.bfloat16)
    mlp.gate_up_proj = MergedColumnParallelLinear(H, [INTER] * 2, bias=False, params_dtype=torch.bfloat16)
    mlp.down_proj = RowParallelLinear(INTER, H, bias=False, params_dtype=torch.bfloat16)
    layer.self_attn, layer.mlp = attn, mlp
    inner.layers.append(layer); m.model = inner
    return m

shapes = {"q_proj.weight": (HEADS * HD, H), "k_proj.weight": (KV * HD, H), "v_proj.weight": (KV * HD, H),
          "q_proj.bias": (HEADS * HD,), "k_proj.bias": (KV * HD,), "v_proj.bias": (KV * HD,),
          "o_proj.weight": (H, HEADS * HD), "gate_proj.weight": (INTER, H), "up_proj.weight": (INTER, H),
          "down_proj.weight": (H, INTER)}
def hf(n): return ("model.layers.0.self_attn." if n[0] in "qkvo" else "model.layers.0.mlp.") + n
g = torch.Generator().manual_seed(0)
old = {hf(n): torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
new = {}
for n, t in old.items():
    t2 = t.clone(); mask = torch.rand(t.shape, generator=g) < (0.3 if "down" in n else 0.02 if "weight" in n else 0.9)
    t2.view(torch.int16)[mask] ^= 3; new[n] = t2  # a small step's change: the low bits
names = list(new)
out, at, kinds = torch.zeros(1 << 20, dtype=torch.uint8), 0, []
for i, n in enumerate(names):  # the encoder's choice (zstd only where it pays: down_proj's 30 %)
    a, b = old[n].reshape(-1), new[n].reshape(-1)
    pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
    kind, body = encode_sparse(b.numel(), pos, b[pos])
    kinds.append(kind)
    at += write_record(out[at:], i, kind, 0, b, None, pos.numel(), body=body)
table = {"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [list(new[n].shape) for n in names], "version": "2"}
payload = [(DELTA_TENSOR + ".table", torch.frombuffer(bytearray(json.dumps(table).encode()), dtype=torch.uint8)),
           (DELTA_TENSOR + ".records", out[:at].clone())]
report = {}
for r in (0, 1):
    served, direct = model(r), model(r)
    with torch.no_grad():
        served.load_weights(list(old.items())); direct.load_weights(list(new.items()))
        load_delta(served, payload)
    a, b = dict(served.named_parameters()), dict(direct.named_parameters())
    report[r] = {n: torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a}
    report[r]["_sliced"] = list(a["model.layers.0.self_attn.qkv_proj.weight"].shape)
report["_kinds"] = kinds
print("REPORT " + json.dumps(report))
'''


def test_the_loader_applies_deltas_to_sglangs_tp_slices_as_its_load_weights_would():
    """SGLang's own QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear built for 2 TP ranks: on
    each rank, the base loaded by SGLang's Qwen2 ``load_weights``, then a delta through the loader (gap and
    zstd records among its kinds), equals the new weights loaded by ``load_weights`` directly, bit for bit."""
    _need()
    code = _TP_CHECK.replace("ROOT", repr(ROOT)).replace("SGLANG_DIR", repr(sglang_dir("0.5.23")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-4000:]
    import json

    report = json.loads(line[len("REPORT "):])
    kinds = report.pop("_kinds")
    assert 5 in kinds and any(k & 16 for k in kinds), kinds  # gaps of 8 bits, and zstd, among them
    for rank, params in report.items():
        sliced = params.pop("_sliced")
        assert sliced[0] == (4 * 16 + 2 * 2 * 16) // 2, f"rank {rank}: qkv_proj is not a TP slice: {sliced}"
        assert params and all(params.values()), f"TP rank {rank}: {params}"


def _loader_payload(name: str, old, new, version: str, probe_bits: int) -> str:
    """One delta bucket for the loader: ``name`` from ``old`` to ``new``, checking one base value."""
    import base64
    import json
    import pickle

    import torch

    from bridge.codecs.delta import DELTA_TENSOR, changed_positions, choose, write_record

    a, b = old.reshape(-1), new.reshape(-1)
    count = int((a.view(torch.int16) != b.view(torch.int16)).sum())
    kind, nbytes = choose(b.numel(), count, 2)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    write_record(out, 0, kind, 0, b, changed_positions(b, a, kind) if kind != 4 else None, count)
    table = {"names": [name], "dtypes": ["bfloat16"], "shapes": [list(new.shape)], "version": version,
             "probes": {name: {"shape": list(new.shape), "items": [[0, probe_bits]]}}}
    payload = [(DELTA_TENSOR + ".table", torch.frombuffer(bytearray(json.dumps(table).encode()), dtype=torch.uint8)),
               (DELTA_TENSOR + ".records", out)]
    return base64.b64encode(pickle.dumps(payload, protocol=4)).decode()


def test_the_loader_refuses_a_delta_on_another_base_before_any_weight_changes(tiny_model_dir):
    """Through SGLang's own route, unpickler and WeightUpdater: a delta whose base values are not what the
    model holds changes nothing (nor does a later bucket of the same version); the right base is applied."""
    _need()
    import os

    import torch
    from safetensors.torch import load_file

    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    name = "model.layers.0.self_attn.q_proj.weight"  # stacked into qkv_proj by SGLang
    weights = {}
    for f in sorted(os.listdir(tiny_model_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(tiny_model_dir, f)))
    old = weights[name].to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[::13] += 1
    bits = int(old.reshape(-1)[0].view(torch.int16))
    with launch("0.5.23", tiny_model_dir, custom_weight_loader=LOADER) as srv:
        c = ServerClient(srv.url)
        before = srv.checksums()["checksums"]
        for version, probe in (("7", bits ^ 1), ("7", bits)):  # the second bucket of a refused version: nothing
            c.begin_weight_update()
            c.update_weights_from_tensor([_loader_payload(name, old, new, version, probe)], load_format=LOADER)
            c.end_weight_update()
            assert srv.checksums()["checksums"] == before, "a refused delta changed SGLang's weights"
        c.begin_weight_update()
        c.update_weights_from_tensor([_loader_payload(name, old, new, "8", bits)], load_format=LOADER)
        c.end_weight_update()
        after = srv.checksums()["checksums"]
        qkv = name.replace("q_proj", "qkv_proj")
        stacked = torch.cat([new, weights[name.replace("q_proj", "k_proj")].to(torch.bfloat16),
                             weights[name.replace("q_proj", "v_proj")].to(torch.bfloat16)])
        assert after[qkv] == tensor_checksum(stacked)
        assert {n for n in after if after[n] != before[n]} == {qkv}
        assert srv.alive()
