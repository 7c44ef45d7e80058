"""The delta byte format (:mod:`bridge.codecs.delta`) on its own: every record kind round-trips bit for bit.

No process is involved: records are written into a buffer, read back with :func:`iter_records` (which every
receiver uses: the reference server, and the loader inside SGLang) and applied to a copy of the base. The
receivers themselves apply the new kinds in ``tests/test_delta.py`` and ``tests/test_delta_sglang.py``.
"""

from __future__ import annotations

import pytest
import torch

from bridge.codecs.delta import (
    BITMASK,
    DENSE,
    GAPS8,
    GAPS16,
    GAPS32,
    HEADER_BYTES,
    SPARSE32,
    SPARSE64,
    ZSTD,
    DeltaFormatError,
    apply_record,
    changed_positions,
    choose,
    encode_sparse,
    iter_records,
    write_record,
)


def _changed(base: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``base`` with the low bits of the elements at ``positions`` changed, as a small step changes them (a NaN
    payload and -0.0 included)."""
    new = base.clone()
    ints = new.view(torch.int16)
    ints[positions] ^= torch.randint(1, 8, (positions.numel(),), generator=torch.Generator().manual_seed(1),
                                     dtype=torch.int16)
    return new


def _round_trip(base: torch.Tensor, new: torch.Tensor, *, zstd: bool = True, kind: int | None = None) -> int:
    """Encode ``base`` -> ``new`` (``kind``: that raw kind, else the encoder's choice), decode, apply: the
    bytes must be ``new``'s. The record's kind as written."""
    positions = torch.nonzero(base.view(torch.int16) != new.view(torch.int16)).squeeze(1)
    out = torch.zeros(HEADER_BYTES + 16 + 8 * new.numel() + 64, dtype=torch.uint8)
    if kind is None:
        kind, body = encode_sparse(new.numel(), positions, new[positions], zstd=zstd)
        size = write_record(out, 0, kind, 0, new, None, positions.numel(), body=body)
    else:
        size = write_record(out, 0, kind, 0, new, changed_positions(new, base, kind) if kind != DENSE else None,
                            positions.numel())
    recs = list(iter_records(out[:size], [new.dtype], [new.numel()]))
    got = base.clone()
    for rec in recs:
        apply_record(got, rec)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16)), (kind, positions.numel())
    return kind


@pytest.fixture(params=["kernels", "numpy"])
def gap_code(request, monkeypatch):
    """Gap records written and read by the C kernels (bridge.codecs.kernels), or without them (numpy), as on a machine
    with no C compiler: the same bytes either way."""
    if request.param == "numpy":
        from bridge.codecs import kernels

        monkeypatch.setattr(kernels, "_library", lambda: None)
    return request.param


@pytest.mark.parametrize("zstd", [False, True], ids=["raw", "zstd"])
def test_every_kind_round_trips_bit_exact(zstd, gap_code):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(200_000, generator=g).to(torch.bfloat16)
    base[:4] = torch.tensor([float("nan"), -0.0, 0.0, float("inf")])
    n = base.numel()
    cases = {  # changed positions -> the kind the encoder must pick (before zstd)
        "none": (torch.empty(0, dtype=torch.int64), SPARSE32),
        "one in 100 at random": (torch.randperm(n, generator=g)[: n // 100].sort().values, GAPS8),
        "one in 1000": (torch.arange(0, n, 1000), GAPS16),
        "three far apart": (torch.tensor([5, 100_000, n - 1]), SPARSE32),
        "a third": (torch.randperm(n, generator=g)[: n // 3].sort().values, BITMASK),
        "all": (torch.arange(n), DENSE),
        "the ends, NaN and -0.0": (torch.tensor([0, 1, 2, 3, n - 1]), SPARSE32),
    }
    for what, (positions, want) in cases.items():
        new = _changed(base, positions)
        got = _round_trip(base, new, zstd=zstd)
        assert got & ~ZSTD == want, (what, got)
        if not zstd:
            assert not got & ZSTD, what
    # zstd where it pays: the values' high bytes (sign and exponent) of 1 % changes compress
    if zstd:
        assert _round_trip(base, _changed(base, cases["one in 100 at random"][0])) == GAPS8 | ZSTD
    # every raw kind, forced (GAPS32 is never the smallest: SPARSE32 is as small and has no escapes)
    new = _changed(base, cases["one in 100 at random"][0])
    for kind in (SPARSE32, SPARSE64, BITMASK, DENSE, GAPS8, GAPS16, GAPS32):
        assert _round_trip(base, new, kind=kind) == kind


@pytest.mark.parametrize("kind,m", [(GAPS8, 255), (GAPS16, 65535)])
def test_gaps_over_the_type_escape(kind, m, gap_code):
    """Distances of exactly M, M + 1, 2M, 2M + 1 and far more between changes: escapes (0 gaps), bit-exact."""
    base = torch.randn(5 * m + 10, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    positions = torch.tensor([m - 1, 2 * m - 1, 3 * m, 5 * m, 5 * m + 1])  # from -1: M, M, M + 1, 2M, 1
    new = _changed(base, positions)
    entries = changed_positions(new, base, kind)
    assert entries.dtype == {GAPS8: torch.uint8, GAPS16: torch.uint16}[kind]
    assert entries.to(torch.int64).tolist() == [m, m, 0, 1, 0, m, 1]
    assert _round_trip(base, new, kind=kind) == kind
    if kind == GAPS8:  # the same positions through the encoder's own choice and zstd
        _round_trip(base, new)


def test_int64_pieces_past_2_31_elements_on_a_sparse_view(gap_code):
    """A piece of 2**32 + 5 elements (never allocated): the choice avoids int32 positions, and the positions a
    gap record carries past 2**31 decode exactly, as :meth:`Record.flat_positions` gives them to SGLang's
    loader."""
    length = 2**32 + 5
    positions = torch.tensor([7, 2**31 - 1, 2**31, 2**31 + 70_000, 2**32 + 4], dtype=torch.int64)
    values = torch.arange(5, dtype=torch.bfloat16)
    kind, _ = choose(length, positions.numel(), 2, positions)
    assert kind not in (SPARSE32, BITMASK, DENSE), kind
    for zstd in (False, True):
        kind, body = encode_sparse(length, positions, values, zstd=zstd)
        out = torch.zeros(HEADER_BYTES + body.numel(), dtype=torch.uint8)
        write_record(out, 0, kind, 3, torch.empty(1, dtype=torch.bfloat16).expand(length), None, 5, body=body)
        (rec,) = iter_records(out, [torch.bfloat16], [length + 3])
        assert rec.flat_positions().tolist() == (positions + 3).tolist()
        assert torch.equal(rec.values.view(torch.int16), values.view(torch.int16))
    assert choose(length, 5, 2)[0] != SPARSE32  # (and without the positions)


def test_malformed_new_records_are_refused_with_their_reason(gap_code):
    base = torch.randn(4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    positions = torch.arange(0, 4096, 40)
    new = _changed(base, positions)
    out = torch.zeros(16384, dtype=torch.uint8)
    size = write_record(out, 0, GAPS8, 0, new, changed_positions(new, base, GAPS8), positions.numel())
    gaps = out[:size].clone()
    gaps[HEADER_BYTES + 8 + 3] = 255  # the gaps now run past the piece's 4096 elements
    with pytest.raises(DeltaFormatError, match="gaps mark"):
        list(iter_records(gaps, [torch.bfloat16], [4096]))
    kind, body = encode_sparse(4096, positions, new[positions])
    size = write_record(out, 0, kind, 0, new, None, positions.numel(), body=body)
    assert kind & ZSTD, kind
    broken = out[:size].clone()
    broken[HEADER_BYTES + 16 + 4 :] ^= 0x5A  # the zstd frame corrupted
    with pytest.raises(DeltaFormatError, match="zstd"):
        list(iter_records(broken, [torch.bfloat16], [4096]))


def test_the_cost_model_sends_a_delta_where_its_bytes_and_diff_cost_less_than_the_full_sync():
    """bridge.codecs.delta_cost: the same 12 % delta, whose diff the last delta's costs put at 0.16 s, goes over a
    link that moved the full bytes in 4 s, not over one that moved them in 0.05 s (its diff alone costs more);
    nothing is decided before a full sync was measured; a diff already spent no longer counts."""
    from bridge.codecs.delta_cost import SyncCosts

    full = 97_000_000
    unmeasured = SyncCosts()
    assert SyncCosts.verdict(unmeasured.state(), 0.12 * full, full, diff=(48_000_000, 5_000_000)) is None
    for full_s, delta_goes in ((4.0, True), (0.05, False)):
        costs = SyncCosts()
        costs.record("anchor", full, full_s + 0.2, (0.2, 0.1, 48_000_000, 1))  # (a diff before an anchor: not its cost)
        costs.record("delta", 2_000_000, 0.3, (0.08, 0.02, 48_000_000, 1_000_000))  # 1.25 ns/element, 20 ns/change
        why = SyncCosts.verdict(costs.state(), 0.12 * full, full, diff=(48_000_000, 5_000_000))
        assert (why is None) == delta_goes, (full_s, why)
        if why is not None:
            assert "its diff, 0.160 s" in why and "the full sync 0.050 s" in why, why
            assert SyncCosts.verdict(costs.state(), 0.12 * full, full) is None  # the diff spent: only the bytes count


def test_the_cost_model_learns_what_delta_bytes_cost_from_the_last_deltas():
    """Where the servers' scattered writes cost more per byte than the link (loopback): two measured deltas,
    2 MB in 0.2 s and 20 MB in 1.1 s after their diff, put a 12 % delta of 97 MB at 0.1 + 0.58 s, over the
    full sync's 0.5 s, though its bytes at the full sync's rate alone would take 0.06 s."""
    from bridge.codecs.delta_cost import SyncCosts

    full, costs = 97_000_000, SyncCosts()
    costs.record("anchor", full, 0.5, (0.0, 0.0, 48_000_000, 0))
    for nbytes, seconds in ((2_000_000, 0.2), (20_000_000, 1.1)):
        costs.record("delta", nbytes, seconds + 0.05, (0.05, 0.0, 48_000_000, 1))
    state = costs.state()
    assert abs(state["fixed"] - 0.1) < 1e-9 and abs(state["per_byte"] - 0.05e-6) < 1e-15, state
    why = SyncCosts.verdict(state, 0.12 * full, full)
    assert why is not None and "the delta would take about 0.682 s" in why, why
    assert SyncCosts.verdict(state, 0.02 * full, full) is None  # 0.197 s


def test_a_delta_goes_only_well_under_the_full_sync_and_one_that_took_longer_is_counted():
    """A delta expected at 95 % of the full sync's time is not sent (the costs are the last syncs', and a load that
    rises makes the delta's CPU work slower): it must be expected under 1 / ``MARGIN`` of it, about nine tenths. A committed delta
    that took longer than the full sync would have is counted and its full-sync time returned, so the encoding logs
    it."""
    from bridge.codecs.delta_cost import MARGIN, SyncCosts

    full, costs = 100_000_000, SyncCosts()
    costs.full_bytes = full
    assert costs.record("anchor", full, 1.0, (0.0, 0.0, 50_000_000, 0)) is None  # 1 s for the full sync
    assert MARGIN == 1.1
    assert SyncCosts.verdict(costs.state(), 0.95 * full, full) is not None  # 0.95 s: not under 0.909 s
    assert SyncCosts.verdict(costs.state(), 0.85 * full, full) is None
    assert costs.record("delta", 2_000_000, 0.4, (0.1, 0.01, 50_000_000, 1_000_000)) is None
    assert costs.record("delta", 2_000_000, 1.3, (0.1, 0.01, 50_000_000, 1_000_000)) == 1.0
    assert (costs.slower, costs.deltas) == (1, 2)


def test_the_zstd_stage_goes_by_delta_zstd_and_in_auto_only_below_its_link_rate():
    """``delta_zstd``: ``on`` and ``off`` as said; ``auto`` (the default) takes the zstd stage only once the last full
    syncs ran below ``ZSTD_AUTO_BELOW_BITS`` end to end (a 100 Mbit/s link, not a 1 Gbit/s one, nor before any full
    sync was measured); never where a server cannot read it. A wrong value is refused, naming the choices."""
    from bridge import PublisherConfig
    from bridge.encodings.delta import DeltaEncoding
    from bridge.encodings.delta_plan import ZSTD_AUTO_BELOW_BITS
    from bridge.errors import ConfigError

    full = 100_000_000
    assert 100e6 < ZSTD_AUTO_BELOW_BITS < 1e9

    def stage(mode: str, full_s: float | None, readable: bool = True) -> bool:
        enc = DeltaEncoding(PublisherConfig(transport="broadcast", servers=["http://127.0.0.1:1"], encoding="delta", delta_zstd=mode), 0, 1)
        if full_s is not None:
            enc.costs.record("anchor", full, full_s, (0.0, 0.0, 1, 0))
        enc.zstd = readable
        return enc._zstd_stage(enc.costs.state())

    slow, fast = full * 8 / 100e6, full * 8 / 1e9  # seconds of the full sync at 100 Mbit/s and 1 Gbit/s
    assert stage("auto", slow) and not stage("auto", fast) and not stage("auto", None)
    assert stage("on", fast) and stage("on", None) and not stage("off", slow)
    assert not stage("on", slow, readable=False) and not stage("auto", slow, readable=False)
    with pytest.raises(ConfigError, match="delta_zstd must be one of auto, on, off"):
        PublisherConfig(transport="broadcast", servers=["http://127.0.0.1:1"], encoding="delta", delta_zstd="yes")
