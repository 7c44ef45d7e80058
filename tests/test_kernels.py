"""The one-pass diff (:mod:`bridge.codecs.kernels`, C built on this machine) finds what the plain torch diff finds (the
positions, new and old values), bit for bit, on every kind of float; it builds once per machine, and without a compiler the delta diffs in torch and says
so. The delta publishes of ``tests/test_delta.py``, ``tests/test_fp8_delta.py`` and the SGLang tiers run through it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bridge.codecs import kernels
from bridge.codecs.diff import INTS


def _plain(new: torch.Tensor, base: torch.Tensor):
    """(positions, new values, old values) the torch way."""
    cast = new.to(base.dtype)
    ints = INTS[base.element_size()]
    positions = torch.nonzero(cast.view(ints) != base.view(ints)).squeeze(1)
    return positions, cast[positions], base[positions]


def _kernel(new: torch.Tensor, base: torch.Tensor):
    n = kernels.room(new.numel())
    return kernels.diff(new, base, torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=base.dtype),
                        torch.empty(n, dtype=base.dtype))


def _same(got, want, ints=torch.int16) -> bool:
    return torch.equal(got[0], want[0]) and all(torch.equal(g.view(ints), w.view(ints)) for g, w in zip(got[1:], want[1:]))


def _every_float32(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` float32 of random bits (every exponent: subnormals, infinities, halfway cases of the bf16 rounding), NaNs
    left out (checked on their own), and the edge values."""
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    bits[bits.view(torch.float32).isnan()] = 0x3F808000  # 1.00390625: halfway between two bf16, ties to even
    edges = [0x7F800000, -0x800000, 0, -2**31, 1, 0x7F7FFFFF, 0x3F818000, 0x3F807FFF, 0x00FFFFFF, 0x7F7F8000]
    bits[: len(edges)] = torch.tensor(edges, dtype=torch.int32)
    return bits.view(torch.float32)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_fused_cast_and_diff_is_torchs_cast_and_compare(threads, monkeypatch):
    """float32 weights against a bfloat16 base: the kernel casts as torch does (ties to even, subnormals, infinities,
    -0.0) and finds exactly the elements whose bf16 bits differ, in pieces not a multiple of its block, in views that
    start anywhere, and split across threads."""
    assert kernels.available(), "the kernel builds on this machine (gcc is part of its setup)"
    monkeypatch.setattr(kernels, "_threads", lambda n: threads if n > 1000 else 1)
    g = torch.Generator().manual_seed(3)
    new_all = _every_float32(200_003, g)
    for n, start in ((1, 0), (31, 5), (33, 0), (1000, 3), (200_000, 3)):
        new = new_all[start:start + n]
        base = new.to(torch.bfloat16)
        for frac in (0.0, 0.01, 0.2):
            changed = base.clone()
            flip = torch.rand(n, generator=g) < frac
            changed.view(torch.int16)[flip] ^= 1
            got, want = _kernel(new, changed), _plain(new, changed)
            assert _same(got, want), (n, start, frac)


def test_a_nan_weight_is_sent_as_a_nan():
    """torch casts a NaN to 0xFFFF in its vectorized loop and to 0x7FC0 in its scalar tail; the kernel writes the
    former: where the base holds the latter, the NaN is sent as a change."""
    new = torch.full((64,), float("nan"))
    base = torch.full((64,), -1, dtype=torch.int16)  # 0xFFFF
    base[:8] = 0x7FC0
    positions, values, _ = _kernel(new, base.view(torch.bfloat16))
    assert positions.tolist() == list(range(8))
    assert (values.view(torch.int16) == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64])
def test_pieces_already_in_the_serving_dtype_are_compared_bit_for_bit(dtype):
    """FP8 rows, scales and bf16 weights: -0.0 against 0.0 and NaN payloads differ, equal bits do not."""
    g = torch.Generator().manual_seed(5)
    ints = INTS[dtype.itemsize]
    for n in (7, 32, 4099):
        base = torch.randint(-100, 100, (n,), generator=g).to(ints).view(dtype) if dtype.itemsize == 1 else \
            torch.randint(-100, 100, (n,), generator=g).to(dtype)
        new = base.clone()
        new.view(ints)[torch.rand(n, generator=g) < 0.05] ^= 1
        new.view(ints)[0] = base.view(ints)[0] ^ (1 << (8 * dtype.itemsize - 1))  # the sign bit (-0.0 vs 0.0)
        got, want = _kernel(new, base), _plain(new, base)
        assert _same(got, want, ints), (dtype, n)


@pytest.mark.parametrize("threads", [1, 3])
def test_with_write_the_base_moves_in_the_same_pass_and_a_piece_that_does_not_fit_stays_as_it_was(threads, monkeypatch):
    """``write``: the base takes the new values where they differ (what the publish's base must hold after it), and
    the old values come back for the undo; a piece with more changes than the room (in every part, or in one of
    three threads' parts while the others fit and wrote theirs) comes back None with the base bit for bit as it was."""
    monkeypatch.setattr(kernels, "_threads", lambda n: threads if n > 1000 else 1)
    g = torch.Generator().manual_seed(11)
    new = _every_float32(30_000, g)
    for frac, part_two in ((0.05, False), (0.6, False), (0.05, True)):
        base = new.to(torch.bfloat16)
        flip = torch.rand(new.numel(), generator=g) < frac
        if part_two:  # only the second of three parts changed beyond its room
            flip[10_000:20_000] = torch.rand(10_000, generator=g) < 0.9
        base.view(torch.int16)[flip] ^= 1
        before, want = base.clone(), _plain(new, base)
        n = kernels.room(new.numel())
        got = kernels.diff(new, base, torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.bfloat16),
                           torch.empty(n, dtype=torch.bfloat16), write=True)
        if frac > 0.25 or (part_two and threads > 1) or (part_two and int(flip.sum()) > n):
            assert got is None and torch.equal(base.view(torch.int16), before.view(torch.int16)), (frac, part_two)
            continue
        assert _same(got, want), (frac, part_two)
        assert torch.equal(base.view(torch.int16), new.to(torch.bfloat16).view(torch.int16))


def test_a_piece_mostly_changed_is_left_to_the_plain_diff():
    """More than a quarter changed does not fit the kernel's room: it says so (None) and the delta diffs that piece
    in torch, with the same result."""
    from bridge.encodings.delta import DeltaEncoding
    from bridge.tensors import ParamSpec

    new = torch.randn(10_000)
    base = (new + 1).to(torch.bfloat16)
    assert _kernel(new, base) is None
    enc = DeltaEncoding.__new__(DeltaEncoding)
    enc._buffers, enc._kernels = {}, True
    positions, values, old = enc._changes(ParamSpec("w", (10_000,), torch.bfloat16), new, base)
    assert old is None  # (the plain way leaves the old values to the caller)
    assert _same((positions, values), _plain(new, base)[:2])


_PROBE = textwrap.dedent("""
    import logging, torch
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from bridge.codecs import kernels
    from bridge.encodings.delta import DeltaEncoding
    from bridge.tensors import ParamSpec
    enc = DeltaEncoding.__new__(DeltaEncoding)
    enc._buffers, enc._kernels = {}, kernels.available()
    new = torch.arange(100, dtype=torch.float32)
    base = new.to(torch.bfloat16)
    base[7] = 0
    positions, values, _ = enc._changes(ParamSpec("w", (100,), torch.bfloat16), new, base)
    print("kernel", enc._kernels, "changed", positions.tolist(), values.tolist())
""")


def _probe(tmp_path, **env):
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "WSYNC_KERNEL_CACHE": str(tmp_path / "cache"), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr


def test_built_once_per_machine_and_without_a_compiler_the_diff_runs_in_torch(tmp_path):
    """The first process builds the library and says where; the next one loads it without a word. With no compiler
    (an empty PATH, no $CC), or with ``WSYNC_KERNELS=0``, the same diff comes out of torch, and one line says why."""
    first, err = _probe(tmp_path)
    assert first == "kernel True changed [7] [7.0]", first
    assert "built the one-pass kernels" in err and str(tmp_path / "cache") in err
    again, err = _probe(tmp_path)
    assert again == first and "built" not in err
    bare, err = _probe(tmp_path / "none", PATH="/nonexistent", CC="")
    assert bare == "kernel False changed [7] [7.0]", bare
    assert "no C compiler ($CC, cc or gcc): the delta diff and the FP8 quantization run in torch" in err
    off, err = _probe(tmp_path, WSYNC_KERNELS="0")
    assert off == bare and "WSYNC_KERNELS=0" in err


def _every_weight(shape, g: torch.Generator) -> torch.Tensor:
    """float32 weights of every magnitude a block meets: normal ones, tiny ones (e4m3 subnormals once scaled), exact
    halfway cases, zeros and -0.0, an all-zero block (the 1e-4 floor), a block whose absmax is a bf16 tie, a block
    with an infinity (its scale infinite, its other values 0)."""
    w = torch.randn(shape, generator=g) * 0.02
    w[:, :64] *= torch.exp2(torch.randint(-30, 4, (shape[0], 64), generator=g).float())
    w[:128, 128:256] = 0.0
    w[0, 0], w[1, 0] = -0.0, 0.0
    w[128:256, 256:384] = torch.randn(128, 128, generator=g) * 1e-6  # under the floor
    w[256, 300] = float("inf")
    return w


@pytest.mark.parametrize("served", [torch.bfloat16, torch.float32])
def test_the_fp8_kernel_makes_torchs_bytes_and_scales(served, monkeypatch):
    """Block FP8 by the kernel (scales taken, or given) against the torch path of :mod:`bridge.codecs.fp8`: the same
    e4m3fn bytes and float32 scales, bit for bit, on one thread and split across three."""
    from bridge.codecs.fp8 import AMAX_FLOOR, FP8_DTYPE, block_amax, block_scales, quantize_rows
    from bridge.sources.fp8 import quantize_own_blocks

    g = torch.Generator().manual_seed(11)
    w = _every_weight((512, 640), g)
    monkeypatch.setenv("WSYNC_KERNELS", "0")
    kernels._library.cache_clear()
    try:
        want_scales = block_scales(block_amax(w, 0, 4, served))
        want = quantize_rows(w, 0, want_scales, served=served)
        want_own = torch.empty_like(want)
        want_own_scales = quantize_own_blocks(w, want_own, served)
    finally:
        monkeypatch.delenv("WSYNC_KERNELS")
        kernels._library.cache_clear()
    assert torch.equal(want_own.view(torch.uint8), want.view(torch.uint8)) and torch.equal(want_own_scales, want_scales)
    for threads in (1, 3):
        monkeypatch.setattr(kernels, "_threads", lambda n, t=threads: t)
        out, grid = torch.empty(w.shape, dtype=FP8_DTYPE), torch.empty(4, 5)
        assert kernels.quantize_blocks(w, served, out, grid, True, AMAX_FLOOR)
        assert torch.equal(grid, want_scales), threads
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), threads
        given = torch.empty(w.shape, dtype=FP8_DTYPE)
        assert kernels.quantize_blocks(w, served, given, want_scales.clone(), False, AMAX_FLOOR)
        assert torch.equal(given.view(torch.uint8), want.view(torch.uint8)), threads
    got_own = torch.empty_like(want)
    assert torch.equal(quantize_own_blocks(w, got_own, served), want_scales)
    assert torch.equal(got_own.view(torch.uint8), want.view(torch.uint8))


def test_e4m3_rounding_of_every_scaled_value():
    """Every float32 a scaled weight can be (|v| <= 448, and past it) rounds to torch's e4m3fn byte: a million random
    bit patterns in that range, and each e4m3 value's neighbours and halfway points."""
    from bridge.codecs.fp8 import AMAX_FLOOR, FP8_DTYPE

    g = torch.Generator().manual_seed(13)
    grid_vals = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8_DTYPE).float()
    grid_vals = grid_vals[grid_vals.isfinite()]
    mids = torch.cat([grid_vals, grid_vals.nextafter(torch.tensor(1e9)), grid_vals.nextafter(torch.tensor(-1e9))])
    bits = torch.randint(0, 0x43E00001, (1 << 20,), dtype=torch.int32, generator=g)  # up to 448 and a bit
    values = torch.cat([bits.view(torch.float32), -bits.view(torch.float32), mids, mids / 2 + mids.roll(1) / 2,
                        torch.tensor([448.0, 464.0, 480.0, 1e9, -1e9])])
    values = values[: values.numel() // 128 * 128].view(128, -1)[:, : (values.numel() // 128) // 128 * 128]
    out, grid = torch.empty(values.shape, dtype=FP8_DTYPE), torch.ones(1, values.shape[1] // 128)
    assert kernels.quantize_blocks(values.contiguous(), torch.float32, out, grid, False, AMAX_FLOOR)
    assert torch.equal(out.view(torch.uint8), values.to(FP8_DTYPE).view(torch.uint8))


def test_gap_records_in_one_pass_are_the_numpy_bytes():
    """The delta's gap records by the C kernels: the gaps written of random increasing positions (distances of every
    size, escapes of 8- and 16-bit gaps among them) are the numpy encoder's, counted back to the same number and last
    position, applied to the same bytes as ``index_copy_`` at the decoded positions, and a position at or past the
    piece's end is found (-1) before anything is written."""
    from bridge.codecs.delta import GAP_KINDS, _distances, _gap_entries

    g = torch.Generator().manual_seed(5)
    for trial in range(40):
        length = int(torch.randint(1, 400_000, (1,), generator=g))
        k = int(torch.randint(0, min(length, 4000) + 1, (1,), generator=g))
        positions = torch.randperm(length, generator=g)[:k].sort().values
        escapes = kernels.gaps_escapes(positions)
        distances = _distances(positions)
        for (kind, dtype), esc in zip(GAP_KINDS.items(), escapes):
            gaps = torch.empty(k + esc, dtype=dtype)
            assert kernels.gaps_write(positions, gaps) == k + esc
            assert torch.equal(gaps.to(torch.int64), _gap_entries(kind, distances).to(torch.int64)), (trial, kind)
            assert kernels.gaps_count(gaps, length) == (k, int(positions[-1]) if k else -1)
            values = torch.randint(-2**15, 2**15, (k,), generator=g, dtype=torch.int16)
            got, want = torch.zeros(length, dtype=torch.int16), torch.zeros(length, dtype=torch.int16)
            assert kernels.gaps_apply(gaps, values, got)
            want.index_copy_(0, positions, values)
            assert torch.equal(got, want), (trial, kind)
            if k:
                assert kernels.gaps_count(gaps, int(positions[-1]))[0] == -1
