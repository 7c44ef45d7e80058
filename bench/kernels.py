"""What the trainer's CPU work per sync costs against the memory it moves: ``python -m bench.profile --kernels``.

Each trainer rank's share of a preset's weights (its FSDP rows of every tensor, as float32), one step of ``lr`` on
every element (as Adam's first steps move them), then, in each rank's own process, all ranks at once as in a sync:

- ``copy``: a plain copy of the rank's float32 weights (reads 4 bytes and writes 4 per element): the floor;
- ``diff``: the delta's diff against the bf16 base as a publish runs it (:mod:`bridge.codecs.kernels`, one pass;
  reads the float32 weight and the bf16 base, 6 bytes per element, writes a position and a value per change);
- ``diff (torch)``: the same diff the plain way (cast, compare, positions, values), as without a C compiler;
- ``fp8 quantize``: block maxima, scales and the e4m3 cast of the quantized weights, as the ``fp8`` encoding makes
  them (reads 4 bytes per element, writes 1); ``fp8 quantize (torch)``: the same without the C kernel.

Each kernel's figure is the bytes it must read and write divided by its time (the median of ``--repeats``), and its
share of the copy's bytes per second in the same process: at 1.0 a kernel costs what moving its bytes costs.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from unittest import mock

__all__ = ["format_kernels", "measure_kernels"]


def _rank_weights(preset: str, rank: int, world: int, lr: float, seed: int = 0):
    """{name: (shape, this rank's float32 rows before the step, after it)} of the preset's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge.local.presets import build_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(preset))
    g = torch.Generator().manual_seed(seed + rank)
    out = {}
    for name, p in model.named_parameters():
        rows = -(-p.shape[0] // world)
        shape = (max(0, min(rows, p.shape[0] - rank * rows)), *p.shape[1:])
        if not shape[0]:
            continue
        before = torch.randn(shape, generator=g).mul_(0.02)
        step = torch.randint(0, 2, shape, generator=g, dtype=torch.int8).float().mul_(2 * lr).sub_(lr)
        out[name] = (tuple(p.shape), before, before + step)
    return out


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: page faults and the kernel's build are not what is measured
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _one_rank(args) -> dict:
    preset, rank, world, lr, repeats = args
    import torch

    torch.set_num_threads(1)  # each rank one core, as the bench's ranks run (OMP_NUM_THREADS=1)
    from bridge.codecs import kernels
    from bridge.codecs.fp8 import BLOCK, FP8_DTYPE, Fp8Rule, block_amax, block_scales, quantize_rows
    from bridge.encodings.delta import DeltaEncoding
    from bridge.sources.fp8 import quantize_own_blocks
    from bridge.tensors import ParamSpec

    weights = _rank_weights(preset, rank, world, lr)
    numel = sum(after.numel() for _, _, after in weights.values())
    bases = {n: before.reshape(-1).to(torch.bfloat16) for n, (_, before, _) in weights.items()}
    copies = {n: torch.empty_like(after) for n, (_, _, after) in weights.items()}
    rule = Fp8Rule()
    quantized = {n: w for n, w in weights.items() if rule.quantized(n, w[0])}
    fp8_out = {n: torch.empty(after.shape, dtype=FP8_DTYPE) for n, (_, _, after) in quantized.items()}
    fp8_numel = sum(after.numel() for _, _, after in quantized.values())

    def encoding(use_kernel: bool) -> DeltaEncoding:
        enc = DeltaEncoding.__new__(DeltaEncoding)
        enc._buffers, enc._kernels = {}, use_kernel and kernels.available()
        return enc

    changed = [0]

    def diff(enc):
        def run():
            changed[0] = 0
            for n, (_, _, after) in weights.items():
                positions, _, _ = enc._changes(ParamSpec(n, after.shape, torch.bfloat16), after, bases[n])
                changed[0] += positions.numel()
        return run

    def copy():
        for n, (_, _, after) in weights.items():
            copies[n].copy_(after)

    def quantize():  # as the fp8 encodings do: in one go where the rank's rows are whole blocks, else scales first
        for n, (_, _, after) in quantized.items():
            if after.shape[0] % BLOCK == 0 and after.shape[1] % BLOCK == 0:
                quantize_own_blocks(after, fp8_out[n], torch.bfloat16)
                continue
            scale = block_scales(block_amax(after, 0, -(-after.shape[0] // BLOCK), torch.bfloat16))
            quantize_rows(after, 0, scale, out=fp8_out[n], served=torch.bfloat16)

    fused, plain = encoding(True), encoding(False)
    rows = {"copy": (_timed(copy, repeats), 8 * numel)}
    rows["diff"] = (_timed(diff(fused), repeats), 6 * numel + 10 * changed[0])
    rows["diff (torch)"] = (_timed(diff(plain), repeats), 6 * numel + 10 * changed[0])
    rows["fp8 quantize"] = (_timed(quantize, repeats), 5 * fp8_numel)
    with mock.patch.object(kernels, "quantize_blocks", lambda *a, **k: False):
        rows["fp8 quantize (torch)"] = (_timed(quantize, repeats), 5 * fp8_numel)
    return {"rank": rank, "elements": numel, "changed": changed[0], "kernel": fused._kernels,
            "rows": {k: {"seconds": s, "bytes": b, "gb_per_s": b / s / 1e9} for k, (s, b) in rows.items()}}


def measure_kernels(preset: str = "medium", nproc: int = 2, lr: float = 1e-6, repeats: int = 5) -> list[dict]:
    """Each rank's figures (see the module docstring), the ranks in processes of their own, at the same time."""
    from bridge.codecs import kernels

    kernels.available()  # built once here, not in each rank at the same time
    with mp.get_context("spawn").Pool(nproc) as pool:
        return pool.map(_one_rank, [(preset, r, nproc, lr, repeats) for r in range(nproc)])


def format_kernels(ranks: list[dict], preset: str, lr: float) -> str:
    lines = [f"kernels on {preset}, lr {lr:g}, {len(ranks)} rank(s) at once, one core each "
             "(GB/s: the bytes each must read and write over its median time; share: of the copy's GB/s):"]
    for r in ranks:
        copy = r["rows"]["copy"]["gb_per_s"]
        lines.append(f"  rank {r['rank']}: {r['elements'] / 1e6:.1f} M elements, {r['changed'] / max(1, r['elements']):.2%} "
                     f"changed in bf16{'' if r['kernel'] else ' (no C kernel: diff is torch)'}")
        for k, v in r["rows"].items():
            lines.append(f"    {k:<20} {v['seconds']:8.4f} s  {v['bytes'] / 1e6:9.1f} MB  {v['gb_per_s']:6.2f} GB/s  "
                         f"share {v['gb_per_s'] / copy:5.2f}")
    return "\n".join(lines)
