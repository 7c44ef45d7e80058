"""The delta loader real SGLang imports: it applies a delta bucket to the model in each TP rank's scheduler.

Start SGLang (0.4.8 or newer) with::

    python -m sglang.launch_server ... --custom-weight-loader bridge.serving.sglang_delta_loader.load_delta

(wsync importable in SGLang's environment; this module and :mod:`bridge.codecs.delta` need only torch). A
publisher with ``encoding="delta"`` then sends each delta bucket as ``/update_weights_from_tensor`` with
``load_format="bridge.serving.sglang_delta_loader.load_delta"``, inside SGLang's update session; SGLang deserializes
the payload with its ``SafeUnpickler`` (two plain tensors: the table as JSON bytes, and the records of
:mod:`bridge.codecs.delta`), moves it to the model's device and calls :func:`load_delta` on every TP rank.

The records are in the trainer's coordinates: whole HF tensors (``q_proj``, ``gate_proj``, ...). SGLang
serves other ones: q/k/v stacked into ``qkv_proj`` and gate/up into ``gate_up_proj``, each TP rank a slice.
So the loader asks SGLang's own ``load_weights`` where each element of an HF tensor lands, once per tensor
and process: it loads a probe (element ``i`` holds ``i + 1``) with every parameter's ``weight_loader``
wrapped so that the parameter it writes holds int32 zeros meanwhile, reads which of the parameter's
elements got which HF element, and keeps that as runs of consecutive elements (a few per tensor and
rank); the real weights are put back untouched. A delta then assigns its new values at exactly those
elements: what SGLang's ``load_weights`` would have written for the whole new tensor. This holds for
loaders that copy (the bf16 models SGLang serves without quantization), not for loaders that transform
the values.

Before anything of a delta is applied, the loader compares the base values the delta's first bucket
carries (a few elements of each tensor, ``probes``) with what the model holds; on a mismatch it applies
nothing of that version, logs ``wsync_reason: delta_base_mismatch`` and leaves every later bucket of the
same version alone. It cannot answer the request with an error (SGLang's scheduler dies on an exception
in a loader), so the publisher guards real SGLang before sending: every server must report the base
version, and after a failed sync into real SGLang the next one is an anchor.
"""

from __future__ import annotations

import json
import logging
import weakref

import torch

from bridge.codecs.delta import DELTA_TENSOR, iter_records
from bridge.codecs.diff import INTS

__all__ = ["load_delta"]

logger = logging.getLogger(__name__)

_maps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> HF name -> [(param, h0, p0, lengths)]
_refused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the version whose delta was refused


@torch.no_grad()
def load_delta(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight loader: apply one delta bucket (see the module docstring)."""
    named = dict(named_tensors)
    table = json.loads(bytes(named[DELTA_TENSOR + ".table"].cpu().tolist()).decode())
    records = named[DELTA_TENSOR + ".records"].cpu()
    version = str(table.get("version"))
    if _refused.get(model) == version:
        return
    maps = _maps.setdefault(model, {})
    problem = _check_probes(model, maps, table.get("probes") or {})
    if problem is not None:
        _refused[model] = version
        logger.error("wsync_reason: delta_base_mismatch: the delta to version %s is against another base (%s); "
                     "nothing of it is applied", version, problem)
        return
    dtypes = [getattr(torch, d) for d in table["dtypes"]]
    numels = [_numel(s) for s in table["shapes"]]
    for rec in iter_records(records, dtypes, numels):
        name = table["names"][rec.tensor]
        pos = rec.flat_positions()
        if pos is None:
            pos = torch.arange(rec.start, rec.start + rec.length, dtype=torch.int64)
        for param, dst, keep in _targets(model, maps, name, table["shapes"][rec.tensor], pos):
            param.data.view(-1)[dst] = rec.values[keep].to(param.device, param.dtype)


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _targets(model, maps: dict, name: str, shape, pos: torch.Tensor):
    """For each parameter an HF tensor's elements land in: (param, its flat elements, which of ``pos``)."""
    if name not in maps:
        maps[name] = _discover(model, name, shape)
    out = []
    for param, h0, p0, length in maps[name]:
        i = torch.searchsorted(h0, pos, right=True) - 1
        ok = i >= 0
        i = i.clamp(min=0)
        ok &= pos < h0[i] + length[i]
        out.append((param, (p0[i] + pos - h0[i])[ok].to(param.device), ok))
    return out


def _check_probes(model, maps: dict, probes: dict) -> str | None:
    """None when the model holds the base values the delta names, else what differs (every TP rank agrees)."""
    problem = None
    for name, entries in probes.items():
        shape, items = entries["shape"], entries["items"]
        pos = torch.tensor([p for p, _ in items], dtype=torch.int64)
        want = torch.tensor([b for _, b in items], dtype=torch.int64)
        for param, dst, keep in _targets(model, maps, name, shape, pos):
            ints = INTS[param.element_size()]
            held = param.data.view(-1)[dst].view(ints).to(torch.int64).cpu()
            if not torch.equal(held, want[keep]):
                problem = f"{name}: the served values differ from the base's"
                break
        if problem:
            break
    return _agree(problem)


def _agree(problem: str | None) -> str | None:
    """Every TP rank of this server refuses when one does (SGLang's TP group, when there is more than one)."""
    try:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
    except Exception:  # no SGLang parallel state (one rank)
        return problem
    if getattr(group, "world_size", 1) <= 1:
        return problem
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return problem or ("another TP rank holds other base values" if int(flag) else None)


def _discover(model, name: str, shape) -> list:
    """Where SGLang's ``load_weights`` puts each element of HF tensor ``name``: runs of consecutive elements
    per parameter, as (param, HF starts, param starts, lengths), sorted by HF start."""
    numel = _numel(shape)
    probe = torch.arange(1, numel + 1, dtype=torch.int64 if numel >= 2**31 - 1 else torch.int32).view(*shape)
    params = dict(model.named_parameters())
    touched: dict[int, tuple] = {}  # id(param) -> (param, its real data)
    originals = {id(p): p.__dict__.get("weight_loader") for p in params.values()}

    def wrap(p, orig):
        def loader(param, loaded, *args, **kwargs):
            if id(param) not in touched:
                touched[id(param)] = (param, param.data, param.requires_grad)
                param.requires_grad_(False)  # (an integer tensor cannot require gradients)
                param.data = torch.zeros(param.shape, dtype=probe.dtype, device=param.device)
            if orig is None:
                param.data.copy_(loaded.reshape(param.shape) if loaded.numel() == param.numel() else loaded)
            else:
                orig(param, loaded, *args, **kwargs)
        return loader

    try:
        for p in params.values():
            p.weight_loader = wrap(p, originals[id(p)])
        model.load_weights([(name, probe)])
    finally:
        for p in params.values():
            if originals[id(p)] is None:
                p.__dict__.pop("weight_loader", None)
            else:
                p.weight_loader = originals[id(p)]
        found = [(param, param.data) for param, _, _ in touched.values()]
        for param, real, grad in touched.values():
            param.data = real
            param.requires_grad_(grad)
    return [_runs(param, seen) for param, seen in found if bool((seen != 0).any())]


def _runs(param, seen: torch.Tensor) -> tuple:
    flat = seen.reshape(-1).cpu()
    p = flat.nonzero().squeeze(1)
    h = flat[p].to(torch.int64) - 1
    order = torch.argsort(h)
    p, h = p[order], h[order]
    brk = torch.ones(p.numel(), dtype=torch.bool)
    brk[1:] = ((p[1:] - p[:-1]) != 1) | ((h[1:] - h[:-1]) != 1)
    starts = brk.nonzero().squeeze(1)
    lengths = torch.diff(torch.cat([starts, torch.tensor([p.numel()])]))
    return param, h[starts], p[starts], lengths
