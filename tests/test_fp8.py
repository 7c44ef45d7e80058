"""FP8 end to end: 2 trainer ranks publish with ``encoding="fp8"`` into reference servers started with
``--quantization fp8``, over broadcast, colocated and disk, with a training step before every publish. After each one the
served FP8 weights, their scales and the unquantized tensors must equal, bit for bit, a quantization of the
trainer's own weights written here (not the project's function), and a greedy answer must equal that of a
local model holding the dequantized weights. A server of the other kind refuses, naming the reason."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests import sync_bodies as sb
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow

FP8 = ["--quantization", "fp8"]
PROJ = re.compile(r"\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight$")  # the tiny preset's projections


def _expected(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The served tensors for the trainer's weights: projections as e4m3fn with fp32 128x128 block scales
    (absmax floored at 1e-4, over 448; the weight times the scale's reciprocal, clamped to +-448), the rest
    in bf16."""
    out = {}
    for n, t in full.items():
        w = t.to(torch.bfloat16)
        if not PROJ.search(n):
            out[n] = w
            continue
        rows, cols = w.shape
        nb, kb = -(-rows // 128), -(-cols // 128)
        padded = torch.zeros(nb * 128, kb * 128)
        padded[:rows, :cols] = w.float()
        scale = padded.abs().view(nb, 128, kb, 128).amax(dim=(1, 3)).clamp(min=1e-4) / 448
        per = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        out[n] = (w.float() * (1.0 / per)).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[n + "_scale_inv"] = scale
    return out


def _check(engine, url: str, version: int) -> dict:
    """Rank 0: every served tensor against :func:`_expected`, the version, and a greedy answer against a local
    bf16 model holding the dequantized weights (collective)."""
    from transformers import AutoModelForCausalLM

    from bridge.client import ServerClient
    from bridge.digest import tensor_checksum

    full = {s.name: t for s, t in engine.iter_full_tensors()}
    if engine.rank != 0:
        return {}
    want = _expected(full)
    c = ServerClient(url)
    got = c.weights_checksum(list(want))
    local = AutoModelForCausalLM.from_config(engine.model_config, dtype=torch.bfloat16).eval()
    deq = {}
    for n, t in want.items():
        if n.endswith("_scale_inv"):
            continue
        s = want.get(n + "_scale_inv")
        if s is not None:
            per = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
            t = (t.float() * per).to(torch.bfloat16)
        deq[n] = t
    local.load_state_dict(deq, strict=False)
    local.tie_weights()
    prompt = [1] + [b + 3 for b in b"rev hello="]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = local.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)[0, len(prompt):].tolist()
    out = c.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 6})
    differ = [n for n, t in want.items() if got["checksums"].get(n) != tensor_checksum(t)]
    return dict(version=c.model_info()["weight_version"], differ=differ, n=len(want),
                scales=sum(n.endswith("_scale_inv") for n in want), answer_equal=out["output_ids"] == expected)


def _publish_fp8(url: str, versions: int, **config) -> list[dict]:
    from bridge import PublisherConfig, WeightPublisher

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(servers=[url], encoding="fp8", bucket_mb=0.1, progress=False, **config))
    out = []
    try:
        for v in range(1, versions + 1):
            sb.train_step(engine, v)
            res = pub.publish(engine, version=v)
            out.append(dict(version=v, encoding=res.encoding, bytes=res.bytes, buckets=res.buckets, path=res.path,
                            servers=res.servers, check=_check(engine, url, v)))
    finally:
        pub.close()
        engine.destroy()
    return out


def _assert_exact(rank0: list[dict], url: str, versions: int) -> None:
    assert [r["version"] for r in rank0] == list(range(1, versions + 1))
    for r in rank0:
        chk = r["check"]
        assert r["encoding"] == "fp8" and r["servers"] == {url: "ok"}, r
        assert chk["scales"] == 14 and chk["n"] > chk["scales"], chk  # 7 projections in each of 2 layers
        assert chk["differ"] == [], f"v{r['version']}: served tensors differ from the quantized trainer: {chk['differ']}"
        assert chk["version"] == str(r["version"]) and chk["answer_equal"], chk
    assert rank0[0]["buckets"] > 2, "the test needs several buckets (and a quantized weight in more than one)"


@pytest.fixture(scope="module")
def fp8_server(server_factory):
    return server_factory(extra_args=FP8)


def test_broadcast_fp8_is_bit_exact_after_every_publish(fp8_server):
    rank0, _ = run_ranks(_publish_fp8, 2, args=(fp8_server.url, 10), timeout=300)
    _assert_exact(rank0, fp8_server.url, 10)
    # Half the bytes: 1 byte per quantized element (+ scales) instead of 2.
    assert rank0[0]["bytes"] < 0.7 * sum(p.numel() * 2 for p in _tiny_params())


def test_colocated_fp8_is_bit_exact(fp8_server):
    rank0, _ = run_ranks(_publish_fp8, 2, args=(fp8_server.url, 3), kwargs=dict(transport="colocated"), timeout=300)
    _assert_exact(rank0, fp8_server.url, 3)


def test_disk_fp8_snapshot_is_bit_exact_and_an_fp8_checkpoint(fp8_server, tmp_path):
    from bridge.client import ServerGroup
    from inference_adapter.watcher import DiskWatcher

    nr_url, root = f"file://{tmp_path / 'nr'}", str(tmp_path / "snap")
    watcher = DiskWatcher(nr_url, "fp8", "t0", ServerGroup([fp8_server.url]))
    watcher.start()
    try:
        rank0, _ = run_ranks(_publish_fp8, 2, args=(fp8_server.url, 4), timeout=300, kwargs=dict(
            transport="disk", name_resolve=nr_url, snapshot_root=root, experiment="fp8", trial="t0",
            keep_snapshots=2, wait_loaded_timeout=60))
    finally:
        watcher.stop()
    _assert_exact(rank0, fp8_server.url, 4)
    with open(os.path.join(rank0[-1]["path"], "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                 "modules_to_not_convert": ["model.embed_tokens", "lm_head"]}, q
    from bridge.snapshot import read_snapshot

    tensors = read_snapshot(rank0[-1]["path"])
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16


def _tiny_params():
    from bridge.local.presets import build_model

    return list(build_model("tiny").parameters())


def _publish_once(url: str, encoding: str) -> str:
    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import BridgeError

    engine = sb.engine()
    pub = WeightPublisher(PublisherConfig(servers=[url], encoding=encoding, progress=False))
    try:
        pub.publish(engine, version=1)
        return "published"
    except BridgeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        pub.close()
        engine.destroy()


def _gather_both_ways() -> dict:
    """Every rank: FSDP-like row chunks of a few weights, gathered by gather_fp8_bucket into rank 0's buckets; one
    bucket where every rank's rows are whole 128-row blocks (aligned, a ragged last block with 200 columns, a
    whole tensor on rank 0), one where they are not (64 rows: the scales need the all_reduce)."""
    import torch.distributed as dist

    import bridge.codecs.fp8 as fp8
    import bridge.sources.fp8 as fp8_gather
    from bridge.buckets import plan_buckets, unflatten_bucket
    from bridge.sources import LocalShard
    from bridge.tensors import ParamSpec

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    shapes = {"model.layers.0.mlp.gate_proj.weight": (512, 256), "model.layers.0.mlp.up_proj.weight": (511, 200),
              "model.layers.0.self_attn.o_proj.weight": (130, 128), "model.norm.weight": (256,),
              "model.layers.1.self_attn.k_proj.weight": (64, 128), "model.layers.1.mlp.down_proj.weight": (512, 256)}
    full = {n: torch.randn(*s, generator=g) * 0.02 for n, s in shapes.items()}
    full["model.layers.0.mlp.gate_proj.weight"][128:256, :128] = 0  # an all-zero block: the 1e-4 floor
    whole = {"model.layers.0.self_attn.o_proj.weight", "model.norm.weight"}
    served = {n: ParamSpec(n, s, torch.bfloat16) for n, s in shapes.items()}

    class Source:
        def local_shards(self, specs):
            out = []
            for s in specs:
                t = full[s.name]
                if s.name in whole:
                    out.append(LocalShard(s, t.reshape(-1) if rank == 0 else None, 0, True))
                    continue
                rows = -(-s.shape[0] // world)
                mine = t[rank * rows: (rank + 1) * rows].reshape(-1)
                out.append(LocalShard(s, mine if mine.numel() else None, rank * rows * (s.numel // s.shape[0]), False))
            return out

    agreed = []
    real = fp8_gather._agreed_scales
    fp8_gather._agreed_scales = lambda names, *a: agreed.append(list(names)) or real(names, *a)
    got, all_reduces = {}, []
    for names in (list(shapes)[:4], list(shapes)[4:]):
        bucket = plan_buckets(fp8.fp8_wire_specs([served[n] for n in names], fp8.Fp8Rule()), 1 << 30)[0]
        out = torch.zeros(bucket.nbytes, dtype=torch.uint8) if rank == 0 else None
        before = len(agreed)
        fp8_gather.gather_fp8_bucket(Source(), bucket, out, served, piece_bytes=64 << 10)  # several pieces
        all_reduces.append(len(agreed) - before)
        if rank == 0:
            got.update({n: t.clone() for n, t in unflatten_bucket(out, bucket.specs)})
    want = _expected(full) if rank == 0 else {}
    differ = [n for n, t in want.items() if not torch.equal(got[n].view(torch.uint8), t.view(torch.uint8))]
    return dict(all_reduces=all_reduces, names=sorted(got), want=sorted(want), differ=differ)


def test_fp8_gather_needs_no_all_reduce_when_each_rank_holds_whole_blocks():
    """Rows in whole 128-row blocks on every rank: each rank's scales are its own (no all_reduce, its rows of the
    scales gathered with its FP8 bytes); the bytes equal the test's own quantization either way."""
    rank0, _ = run_ranks(_gather_both_ways, 2, timeout=120)
    assert rank0["all_reduces"] == [0, 1], rank0["all_reduces"]
    assert rank0["names"] == rank0["want"] and len(rank0["names"]) == 11, rank0["names"]
    assert rank0["differ"] == [], f"gathered FP8 bytes differ from the test's quantization: {rank0['differ']}"
    # One trainer rank holds every row: its scales are its own, those of a weight with fewer than 128 rows (64) or a
    # partial last block (511, 130 rows) too.
    (one,) = run_ranks(_gather_both_ways, 1, timeout=120)
    assert one["all_reduces"] == [0, 0] and one["names"] == one["want"], one
    assert one["differ"] == [], f"one rank: gathered FP8 bytes differ from the test's quantization: {one['differ']}"


def test_server_finds_an_fp8_nan_at_any_byte():
    """The reference server's finite check reads FP8 bytes 8 at a time: a NaN (0x7F or 0xFF) is found at every
    position of views that start and end off 8-byte boundaries, and no other byte value is taken for one."""
    from inference_adapter.checks import _non_finite

    for value in range(256):  # every byte value, in the 8-byte body and in a ragged end
        for pos in (5, 17):
            b = torch.zeros(20, dtype=torch.uint8)
            b[pos] = value
            assert _non_finite({"w": b.view(torch.float8_e4m3fn)}) == (["w"] if value & 0x7F == 0x7F else []), (value, pos)
    buf = torch.zeros(64, dtype=torch.uint8)
    for start in range(9):
        for pos in range(start, start + 30):
            b = buf.clone()
            b[pos] = 0xFF
            assert _non_finite({"w": b[start: start + 30].view(torch.float8_e4m3fn)}) == ["w"], (start, pos)


def test_fp8_plan_starts_with_small_buckets():
    """Nothing hides the first bucket's quantization: the fp8 plan's first bucket holds 1/8 of a bucket, the next
    ones double up to the bucket size, and every wire tensor is in one bucket, in order."""
    from types import SimpleNamespace

    from bridge import PublisherConfig
    from bridge.buckets import plan_buckets
    from bridge.codecs.fp8 import Fp8Rule, fp8_wire_specs
    from bridge.encodings.fp8 import Fp8Encoding
    from bridge.tensors import ParamSpec

    served = [ParamSpec(f"model.layers.{i}.mlp.{p}_proj.weight", (256, 256), torch.bfloat16)
              for i in range(16) for p in ("gate", "up", "down")]  # 64 KiB each as FP8 (+ 16 bytes of scales)
    config = PublisherConfig(servers=["http://127.0.0.1:1"], encoding="fp8", bucket_mb=1, progress=False)
    planned = Fp8Encoding(config, 0, 1).plan(SimpleNamespace(buckets=plan_buckets(served, config.bucket_bytes)), [])
    quantized = [sum(s.dtype == torch.float8_e4m3fn for s in b.specs) for b in planned.buckets]
    assert quantized == [1, 3, 7, 15, 15, 7], [b.nbytes for b in planned.buckets]
    assert sorted((s for b in planned.buckets for s in b.specs), key=lambda s: s.name) == \
        sorted(fp8_wire_specs(served, Fp8Rule()), key=lambda s: s.name)
    assert "quantization_config" in planned.config_fields


def test_each_kind_of_server_refuses_the_other_kind_of_bytes(fp8_server, ref_server):
    """A publisher checks first (nothing moves); a bucket sent anyway is refused by the server, with
    ``wsync_reason: quantization_mismatch``, and nothing is applied."""
    from bridge.codecs.fp8 import quantize
    from bridge.errors import ServerError
    from bridge.protocol import QUANTIZATION_MISMATCH
    from tests.fixtures_server import Trainer

    for encoding in ("fp8", "fp8_delta"):  # (the FP8 delta's first sync, an anchor, is the FP8 full sync)
        errors = run_ranks(_publish_once, 2, args=(ref_server.url, encoding), timeout=120)
        assert all("quantization_mismatch" in e and "--quantization fp8" in e and "nothing was sent" in e for e in errors), errors
    errors = run_ranks(_publish_once, 2, args=(fp8_server.url, "full"), timeout=120)
    assert all("quantization_mismatch" in e and "encoding='fp8'" in e for e in errors), errors

    name = "model.layers.0.mlp.down_proj.weight"
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    q, s = quantize(w)
    for server, tensors, says in (
        (fp8_server, [(name, w)], "serves it as block FP8"),
        (ref_server, [(name, q), (name + "_scale_inv", s)], "not started with --quantization fp8"),
    ):
        c = server.client
        before = c.weights_checksum([name])["checksums"]
        c.begin_weight_update()  # (the refusal aborts the session)
        with Trainer([c]) as t:
            (answer,) = t.send(tensors, flattened=True, weight_version="99")
        assert isinstance(answer, ServerError) and answer.reason == QUANTIZATION_MISMATCH, answer
        assert says in str(answer) and "Nothing was applied" in str(answer), answer
        assert c.weights_checksum([name])["checksums"] == before
