"""Where the publisher reads weights from: anything that yields full tensors in a fixed order.

The publisher never imports the trainer. It takes a :class:`WeightSource`: an object with
``param_specs()`` and ``iter_full_tensors(specs)`` (the FSDP2 engine in ``trainer/`` is one), or a plain
``torch.nn.Module`` (sharded with FSDP2 or not), which :func:`as_source` wraps in a :class:`ModuleSource`.

``iter_full_tensors`` is collective when parameters are DTensors: every rank calls it with the same
specs and consumes it to the end; rank 0 receives full tensors, the other ranks ``None``.

A source may offer more; each optional capability is named in :data:`CAPABILITIES` and found once, when
:func:`check_source` wraps the source in a :class:`CheckedSource` (the publisher asks that object, never
the source):

- ``gather_bucket(bucket, out, group=None, dst=0)`` (:class:`GathersBuckets`), the fast path:
  :func:`gather_bucket_into` moves a whole bucket of FSDP2 shards to rank ``dst`` (rank 0, or the rank
  whose part of the sync handles the bucket, such as disk's per-rank writers) in a few flat ``gather``
  calls (one per 1-16 MiB piece) and writes each parameter's rows straight into the bucket's wire
  buffer. One collective per piece instead of one all-gather per parameter, and only ``dst`` receives.
  A ``gather_bucket`` that takes no ``dst`` gathers to rank 0 only.
- ``local_digest()`` (:class:`Digests`): a checksum of this rank's own shards, which tells a retry of a
  version (same weights) from new weights under the same version (the full encoding; the delta encoding
  compares with its base instead).
- ``local_shards(specs)`` (:class:`LocalShards`): this rank's own part of each parameter, with no
  communication (:func:`local_shards_of`); the delta encoding diffs it against the base it keeps.
- ``model_config`` / ``tokenizer`` attributes (the module's ``config`` also counts): written into disk
  snapshots, so that a snapshot is a loadable HF model folder.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from bridge.buckets import Bucket, pack_one
from bridge.errors import ConfigError
from bridge.failpoints import failpoint
from bridge.tensors import ParamSpec, kept_buffer

__all__ = [
    "CAPABILITIES", "CheckedSource", "Digests", "GathersBuckets", "LocalShard", "LocalShards", "ModuleSource",
    "WeightSource", "as_source", "check_source", "gather_bucket_into", "local_digest", "local_shards_of", "row_sharded",
    "shard_nbytes", "tied_embedding_names",
]


@runtime_checkable
class WeightSource(Protocol):
    def param_specs(self) -> list[ParamSpec]:
        """HF names, global shapes and dtypes, identical and identically ordered on every rank."""

    def iter_full_tensors(self, specs: Sequence[ParamSpec] | None = None) -> Iterator[tuple[ParamSpec, torch.Tensor | None]]:
        """Collective: yields each spec with its full tensor on rank 0 and None elsewhere."""


@runtime_checkable
class GathersBuckets(Protocol):
    """Optional capability ``gather_bucket``: a whole bucket to one rank in a few flat gathers."""

    def gather_bucket(self, bucket: Bucket, out: torch.Tensor | None, group=None, dst: int = 0) -> None:
        """Collective: fill rank ``dst``'s ``out`` (uint8, ``bucket.nbytes``) with the bucket's full tensors."""


@runtime_checkable
class Digests(Protocol):
    """Optional capability ``local_digest``: a checksum of this rank's own shards, no communication."""

    def local_digest(self) -> int:
        """The same number on a rank exactly when its shards hold the same bytes."""


class LocalShard(NamedTuple):
    """One parameter as this rank holds it: ``local`` (its rows, or the whole tensor; None when this rank
    holds none of it or another rank owns the whole tensor), the flat element offset of ``local`` in the
    full tensor, and ``whole``: the parameter is not row-sharded, so one rank (rank 0) owns all of it."""

    spec: ParamSpec
    local: torch.Tensor | None
    start: int
    whole: bool


@runtime_checkable
class LocalShards(Protocol):
    """Optional capability ``local_shards``: each parameter's part on this rank, no communication."""

    def local_shards(self, specs: Sequence[ParamSpec]) -> list[LocalShard]:
        """One :class:`LocalShard` per spec, in order (see :func:`local_shards_of`)."""


CAPABILITIES = ("gather_bucket", "gather_to_any_rank", "local_digest", "local_shards", "model_config", "tokenizer")
"""The optional capabilities a weight source may have, as a transport names them in ``source_needs``."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hf_name(name: str) -> str:
    # Wrappers (torch.compile, activation checkpointing, old FSDP) insert these; HF names have none.
    for junk in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


def tied_embedding_names(module: torch.nn.Module) -> tuple[str, str] | None:
    """(input embedding, output head) parameter names when the head *is* the input embedding's weight.

    The one rule for tied embeddings (the trainer and the publisher both use it): the parameters are
    one object, as ``tie_weights()`` makes them and FSDP2 keeps them; a config flag alone is not enough.
    SGLang expects the head of a tied model not to be sent.
    """
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    inp, out = get_in(), get_out()
    if inp is None or out is None or out.weight is not inp.weight:
        return None
    names = {id(m): n for n, m in module.named_modules()}
    return f"{names[id(inp)]}.weight", f"{names[id(out)]}.weight"


class ModuleSource:
    """A :class:`WeightSource` over an ``nn.Module`` whose parameters may be FSDP2 DTensors.

    Tied weights are sent once, under their first name (for HF causal LMs with tied embeddings,
    ``lm_head.weight`` is skipped, as SGLang expects).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._params: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, p in module.named_parameters(remove_duplicate=False):
            key = id(p)
            if key in seen:
                continue
            seen.add(key)
            self._params[_hf_name(name)] = p
        tied = tied_embedding_names(module)
        if tied is not None:
            self._params.pop(_hf_name(tied[1]), None)

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self._params.items()]  # DTensor.shape is global

    def gather_bucket(self, bucket: Bucket, out: torch.Tensor | None, group=None, dst: int = 0) -> None:
        gather_bucket_into([(s, self._params[s.name]) for s in bucket.specs], bucket, out, group=group, dst=dst)

    def local_digest(self) -> int:
        return local_digest(self._params.items())

    def local_shards(self, specs: Sequence[ParamSpec]) -> list[LocalShard]:
        return local_shards_of([(s, self._params[s.name]) for s in specs])

    def iter_full_tensors(self, specs: Sequence[ParamSpec] | None = None) -> Iterator[tuple[ParamSpec, torch.Tensor | None]]:
        rank = _rank()
        for spec in specs if specs is not None else self.param_specs():
            # Cast the local shard before gathering: a bf16 sync gathers half the bytes.
            p = self._params[spec.name].detach().to(spec.dtype)
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield spec, (full if rank == 0 else None)
            del full


PIECE_BYTES = 16 << 20
"""Largest flat gather: big enough to amortise a collective's latency."""


def piece_bytes_for(bucket_bytes: int, world: int) -> int:
    """Bytes per flat gather for a bucket: rank 0 holds ``world`` received pieces plus its own send
    piece next to two buckets, so pieces are kept to an eighth of a bucket over all ranks (at most
    ~0.2 x bucket extra, keeping rank 0 under 2.5 x bucket), between 1 MiB and :data:`PIECE_BYTES`."""
    return max(1 << 20, min(PIECE_BYTES, bucket_bytes // (8 * max(1, world))))


def row_sharded(p: torch.Tensor, world: int) -> bool:
    """True for an FSDP2 parameter: a DTensor sharded on dim 0 over all ranks of the default group."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return False
    mesh = p.device_mesh
    return mesh.ndim == 1 and mesh.size() == world and tuple(p.placements) == (Shard(0),)


def shard_nbytes(spec: ParamSpec, world: int) -> int:
    """Bytes of one rank's rows of a row-sharded ``spec`` (``torch.chunk``'s ``ceil(rows / world)`` rows; the last
    ranks hold fewer, or none): rank ``r``'s rows start ``r`` times this far into the tensor."""
    return -(-spec.shape[0] // world) * (spec.nbytes // spec.shape[0])


@torch.no_grad()  # no autograd bookkeeping: DTensor.to_local() costs ~2 us instead of ~19 us per parameter
def gather_bucket_into(items: Sequence[tuple[ParamSpec, torch.Tensor]], bucket: Bucket, out: torch.Tensor | None,
                       piece_bytes: int | None = None, group: dist.ProcessGroup | None = None, dst: int = 0,
                       scratch: dict | None = None) -> None:
    """Collective: fill rank ``dst``'s ``out`` (the bucket's uint8 wire buffer) with the full parameters.

    ``dst`` is rank 0 for the transports that send from rank 0; the disk transport gathers each bucket
    to the rank that writes its shard, so no rank receives more than its share of the model.

    ``items`` are (wire spec, parameter) in ``bucket.specs`` order, the same on every rank. Parameters
    sharded on dim 0 (FSDP2) travel in flat pieces; anything else (replicated tensors, other
    placements) is gathered one by one. Shards are cast to the wire dtype before they travel.
    ``torch.chunk`` semantics decide the rows of rank r: ``[r*c, min((r+1)*c, d0))`` with
    ``c = ceil(d0 / world)``, so every send buffer is padded to ``c`` rows per parameter.

    ``scratch``: a dict the caller keeps from one gather of the same bucket to the next (an adapter's, at every
    publish), where the send and receive buffers stay to be reused: fresh memory costs a page fault per page at its
    first touch, more than the copies into it. One gather at a time per dict.
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
    piece_bytes = piece_bytes if piece_bytes is not None else piece_bytes_for(bucket.nbytes, world)
    offsets = dict(zip(bucket.names, bucket.offsets))
    piece: list[tuple[ParamSpec, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal piece, size
        if piece:
            _gather_piece(piece, offsets, out, world, rank, group, dst, scratch)
        piece, size = [], 0

    for spec, p in items:
        if world > 1 and row_sharded(p, world):
            padded = shard_nbytes(spec, world)
            if piece and size + padded > piece_bytes:
                flush()
            piece.append((spec, p))
            size += padded
            continue
        flush()
        full = p.to(spec.dtype)
        full = full.full_tensor() if isinstance(full, DTensor) else full
        if out is not None:
            out[offsets[spec.name] : offsets[spec.name] + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(full)
        del full
    flush()


def _buffer(scratch: dict | None, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of uint8 on ``device``: kept in ``scratch`` under ``key`` and reused (grown when too small), or fresh
    without a ``scratch``."""
    if scratch is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return kept_buffer(scratch, key, nbytes, torch.uint8, device)


def _gather_piece(piece, offsets: dict[str, int], out: torch.Tensor | None, world: int, rank: int, group, dst: int,
                  scratch: dict | None = None) -> None:
    layout = []  # (spec, rows per rank c, bytes per row, offset in the send buffer)
    total = 0
    for spec, _ in piece:
        row = spec.nbytes // spec.shape[0]
        c = -(-spec.shape[0] // world)
        layout.append((spec, c, row, total))
        total += c * row
    device = piece[0][1].to_local().device  # (gather_bucket_into runs under no_grad)
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # CPU-offloaded shards under NCCL
    send = _buffer(scratch, "send", total, device)
    locals_ = [p.to_local() for _, p in piece]
    for (spec, _), local, (_, c, _row, _off) in zip(piece, locals_, layout):
        expected = max(0, min(c, spec.shape[0] - rank * c))
        assert local.shape[0] == expected, f"{spec.name}: rank {rank} holds {local.shape[0]} rows, chunking says {expected}"
    wire = {spec.dtype for spec, _ in piece}
    if len(piece) > 1 and len(wire) == 1 and all(local.shape[0] == c for local, (_, c, _, _) in zip(locals_, layout)):
        # Every shard fills its c rows (no padding): cast and pack them all in one call (a LoRA adapter's 224
        # small shards cost one copy_ each otherwise).
        torch.cat([local.reshape(-1) for local in locals_], out=send.view(wire.pop()))
    else:
        for (spec, _), local, (_, _c, _row, off) in zip(piece, locals_, layout):
            if local.numel():  # cast, move and pack in one copy
                send[off : off + local.numel() * spec.dtype.itemsize].view(spec.dtype).view(local.shape).copy_(local)
    failpoint("gather", rank)  # (fault tests: the other ranks are already waiting in this gather)
    if rank != dst:
        dist.gather(send, None, dst=dst, group=group)
        return
    if out is not None and len(piece) == 1 and out.device == device:
        # One parameter: rank r's rows are one contiguous span of the bucket, so they land there directly.
        # A last rank with fewer rows than the others (its chunk is padded) lands in a scratch tensor.
        spec, c, row, _ = layout[0]
        base = offsets[spec.name]
        spans = [(base + r * c * row, max(0, min(c, spec.shape[0] - r * c)) * row) for r in range(world)]
        recv = [out[b : b + total] if n == total else torch.empty(total, dtype=torch.uint8, device=device) for b, n in spans]
        dist.gather(send, recv, dst=dst, group=group)
        for (b, n), buf in zip(spans, recv):
            if n != total and n:
                out[b : b + n].copy_(buf[:n])
        return
    recv = _buffer(scratch, "recv", world * total, device)
    dist.gather(send, list(recv.split(total)), dst=dst, group=group)
    del send
    if out is None:
        return
    first, last = offsets[layout[0][0].name], offsets[layout[-1][0].name] + layout[-1][0].nbytes
    if last - first == sum(spec.nbytes for spec, *_ in layout):
        # The piece's parameters lie side by side in the bucket: its bytes are rank 0's rows then rank 1's... of
        # each parameter in turn, so one split of what arrived and one concatenation fill it.
        sizes = []
        for r in range(world):
            for spec, c, row, _off in layout:
                n = max(0, min(c, spec.shape[0] - r * c)) * row
                sizes += [n, c * row - n]  # the rows of rank r, then its padding
        parts = recv.split(sizes)
        k = len(layout)
        torch.cat([parts[2 * (r * k + i)] for i in range(k) for r in range(world)], out=out[first:last])
        return
    for spec, c, row, off in layout:
        base = offsets[spec.name]
        for r in range(world):
            n = max(0, min(c, spec.shape[0] - r * c)) * row
            if n:
                out[base + r * c * row : base + r * c * row + n].copy_(recv[r * total + off : r * total + off + n])


@torch.no_grad()
def local_digest(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """CRC32 of this rank's own bytes of every tensor (its FSDP2 shard, or the whole tensor), in order.

    Cheap (one pass over the bytes, no communication): with the full encoding each rank takes it while a version's
    buckets travel, and again at a retry of that version, to tell the same weights from new weights
    under the same version (refused before the first byte reaches a server).
    """
    crc = 0
    for name, t in named:
        local = t.to_local() if isinstance(t, DTensor) else t  # a DTensor's detach() costs ~19 us, a tensor's ~1
        local = local.detach().contiguous()
        if local.device.type != "cpu":
            local = local.cpu()
        crc = zlib.crc32(name.encode(), crc)
        if local.numel():
            crc = zlib.crc32(local.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


@torch.no_grad()
def local_shards_of(items: Sequence[tuple[ParamSpec, torch.Tensor]]) -> list[LocalShard]:
    """This rank's own part of each (spec, parameter), flattened, without communication.

    An FSDP2 parameter (a DTensor sharded on dim 0 over every rank) gives this rank's rows, which start
    at flat element ``rank * ceil(rows / world) * row`` (``torch.chunk``); a replicated DTensor or a plain
    tensor is whole, and rank 0 owns it. The local tensors are views: nothing is copied or gathered.

    Raises:
        ConfigError: a DTensor placed otherwise (sharded on another dim, or over a part of the ranks).
    """
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else (1, 0)
    out = []
    for spec, p in items:
        if row_sharded(p, world):
            local = p.to_local().reshape(-1)
            rows = -(-spec.shape[0] // world)
            out.append(LocalShard(spec, local if local.numel() else None, rank * rows * (spec.numel // spec.shape[0]),
                                  False))
            continue
        if isinstance(p, DTensor):
            if not all(pl.is_replicate() for pl in p.placements):
                raise ConfigError(f"{spec.name}: a DTensor placed {tuple(p.placements)}; the delta encoding reads "
                                  "FSDP2 shards (Shard(0) over every rank) or replicated tensors")
            p = p.to_local()
        out.append(LocalShard(spec, p.reshape(-1) if rank == 0 and p.numel() else None, 0, True))
    return out


def as_source(obj) -> WeightSource:
    """Return ``obj`` if it already is a WeightSource, else wrap an ``nn.Module``."""
    if isinstance(obj, WeightSource) and not isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, torch.nn.Module):
        return ModuleSource(obj)
    raise TypeError(f"cannot publish a {type(obj).__name__}: pass an nn.Module or an object with param_specs() and iter_full_tensors()")


def check_source(obj) -> CheckedSource:
    """Wrap ``obj`` (a WeightSource or an ``nn.Module``) once per publish: its capabilities, found now."""
    return obj if isinstance(obj, CheckedSource) else CheckedSource(as_source(obj))


class CheckedSource:
    """A weight source as the publisher uses it: what it can do is found once, here, and asked by name."""

    def __init__(self, source: WeightSource):
        self.source = source
        self._gather = source.gather_bucket if isinstance(source, GathersBuckets) else None
        self._digest = source.local_digest if isinstance(source, Digests) else None
        self.local_shards = source.local_shards if isinstance(source, LocalShards) else None
        """``local_shards(specs)`` when the source has it (capability ``local_shards``), else None."""
        self.gathers_to_any_rank = self._gather is not None and _takes_dst(self._gather)
        """Buckets can be gathered to any rank (else to rank 0 only)."""
        self.model_config = _model_config(source)
        self.tokenizer = getattr(source, "tokenizer", None)
        self.capabilities = frozenset(name for name, present in (
            ("gather_bucket", self._gather is not None), ("gather_to_any_rank", self.gathers_to_any_rank),
            ("local_digest", self._digest is not None), ("local_shards", self.local_shards is not None),
            ("model_config", self.model_config is not None),
            ("tokenizer", self.tokenizer is not None),
        ) if present)

    def require(self, needs: Sequence[str], who: str) -> None:
        """A ConfigError naming what ``who`` (a transport) needs and this source lacks."""
        missing = [n for n in needs if n not in self.capabilities]
        if missing:
            raise ConfigError(f"{who} needs a weight source with {', '.join(missing)}; "
                              f"{type(self.source).__name__} has {sorted(self.capabilities) or 'none of them'}")

    def param_specs(self) -> list[ParamSpec]:
        return self.source.param_specs()

    def gather(self, bucket: Bucket, buf: torch.Tensor | None, group, dst: int = 0) -> None:
        """Collective: fill rank ``dst``'s wire buffer with the bucket, by the fast path when the source has
        one (``dst`` other than 0 only when :attr:`gathers_to_any_rank`), else tensor by tensor."""
        if self._gather is not None:
            if dst:
                self._gather(bucket, buf, group=group, dst=dst)
            else:
                self._gather(bucket, buf, group=group)
            return
        index = bucket.index() if buf is not None else None
        for spec, full in self.source.iter_full_tensors(bucket.specs):
            if buf is not None:
                offset, wire = index[spec.name]
                pack_one(buf, offset, wire, full)
            del full

    def digest(self) -> int | None:
        """This rank's digest, or None when the source cannot tell."""
        return self._digest() if self._digest is not None else None

    def digest_in_background(self) -> Future | None:
        """The digest, computed on a thread while the buckets travel (crc32 releases the GIL)."""
        if self._digest is None:
            return None
        global _digest_thread
        if _digest_thread is None:  # one thread for the life of the process: starting one per sync cost ms
            _digest_thread = ThreadPoolExecutor(1, thread_name_prefix="wsync-digest")
        return _digest_thread.submit(self._digest)  # an error surfaces at settle, through the agreement


_digest_thread: ThreadPoolExecutor | None = None


def _takes_dst(gather) -> bool:
    try:
        return "dst" in inspect.signature(gather).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the documented one
        return False


def _model_config(source) -> Any:
    """The HF config a snapshot of ``source`` carries: its ``model_config``, or its module's ``config``."""
    for obj in (source, getattr(source, "module", None), getattr(source, "model", None)):
        cfg = getattr(obj, "model_config", None) or getattr(obj, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            return cfg
    return None
