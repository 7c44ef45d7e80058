"""Where the publisher reads weights from: anything that yields full tensors in a fixed order.

The publisher never imports the trainer. It takes a :class:`WeightSource`: an object with
``param_specs()`` and ``iter_full_tensors(specs)`` (the FSDP2 engine in ``trainer/`` is one), or a plain
``torch.nn.Module`` (sharded with FSDP2 or not), which :func:`as_source` wraps in a :class:`ModuleSource`.

``iter_full_tensors`` is collective when parameters are DTensors: every rank calls it with the same
specs and consumes it to the end; rank 0 receives full tensors, the other ranks ``None``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from bridge.tensors import ParamSpec

__all__ = ["ModuleSource", "WeightSource", "as_source"]


@runtime_checkable
class WeightSource(Protocol):
    def param_specs(self) -> list[ParamSpec]:
        """HF names, global shapes and dtypes, identical and identically ordered on every rank."""

    def iter_full_tensors(self, specs: Sequence[ParamSpec] | None = None) -> Iterator[tuple[ParamSpec, torch.Tensor | None]]:
        """Collective: yields each spec with its full tensor on rank 0 and None elsewhere."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hf_name(name: str) -> str:
    # Wrappers (torch.compile, activation checkpointing, old FSDP) insert these; HF names have none.
    for junk in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(junk, "")
    return name


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
        tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
        if tied:
            self._params.pop("lm_head.weight", None)

    def param_specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self._params.items()]  # DTensor.shape is global

    def iter_full_tensors(self, specs: Sequence[ParamSpec] | None = None) -> Iterator[tuple[ParamSpec, torch.Tensor | None]]:
        rank = _rank()
        for spec in specs if specs is not None else self.param_specs():
            # Cast the local shard before gathering: a bf16 sync gathers half the bytes.
            p = self._params[spec.name].detach().to(spec.dtype)
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield spec, (full if rank == 0 else None)
            del full


def as_source(obj) -> WeightSource:
    """Return ``obj`` if it already is a WeightSource, else wrap an ``nn.Module``."""
    if isinstance(obj, WeightSource) and not isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, torch.nn.Module):
        return ModuleSource(obj)
    raise TypeError(f"cannot publish a {type(obj).__name__}: pass an nn.Module or an object with param_specs() and iter_full_tensors()")
