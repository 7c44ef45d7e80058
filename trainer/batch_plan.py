"""The work of one step, agreed by every rank before the first forward pass.

FSDP's collectives need every rank to run the same number of forward/backward passes, and the loss
scale needs the total weight over all ranks. :func:`plan_batch` packs this rank's batch, then one
all-gather tells each rank every other rank's micro-batch count, weight, token count, and whether it
failed to prepare its batch: a rank's error is raised on every rank, so no rank is left waiting in a
collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from bridge.errors import ConfigError
from trainer.data import MicroBatch, dummy_micro_batch, pack_micro_batches, validate_batch

__all__ = ["BatchPlan", "plan_batch"]


@dataclass
class BatchPlan:
    """One rank's share of a step. ``micro_batches`` and ``weights`` have the same length on every rank."""

    micro_batches: list[TensorDictBase]
    """On this rank's device; padded with dummies up to the largest count of any rank."""
    weights: list[float]
    """Each micro-batch's loss weight; 0 for the dummies."""
    total_weight: float
    """Sum of the weights over all ranks (> 0)."""
    n_tokens: int
    """Tokens over all ranks."""
    packed: list[MicroBatch]
    """This rank's real micro-batches, with the rows and columns of the batch each came from."""


def plan_batch(
    batch: TensorDictBase,
    loss_weight_fn: Callable[[TensorDictBase], float],
    *,
    mb_max_tokens: int,
    pad_token_id: int,
    device: torch.device,
) -> BatchPlan:
    """Validate and pack this rank's ``batch`` and agree with the other ranks on the work (collective).

    Raises:
        ConfigError: on every rank, when any rank's batch is empty or malformed, a weight is negative or
            not finite, or the weights sum to zero over all ranks. The failing rank raises its own error.
    """
    error: Exception | None = None
    packed: list[MicroBatch] = []
    weights: list[float] = []
    try:
        validate_batch(batch)
        packed = pack_micro_batches(batch, mb_max_tokens)
        for mb in packed:
            w = float(loss_weight_fn(mb.data))
            if not (w >= 0 and math.isfinite(w)):
                raise ConfigError(f"loss_weight_fn returned {w}; a micro-batch weight must be finite and >= 0")
            weights.append(w)
    except Exception as e:  # any type (a user's loss_weight_fn may raise anything): the others must hear of it
        error = e
    n_tokens = sum(mb.n_tokens for mb in packed)
    local = torch.tensor(
        [float(error is not None), len(packed), sum(weights), n_tokens],
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)  # one collective answers all four questions
    stats = torch.stack(everyone).cpu()
    bad = [r for r in range(len(everyone)) if stats[r, 0] > 0]
    if error is not None:
        raise error
    if bad:
        raise ConfigError(f"rank(s) {bad} failed to prepare their batch (see their error); no step was taken")
    total_weight = float(stats[:, 2].sum())
    if total_weight <= 0:
        raise ConfigError(
            "the loss weights sum to 0 over all ranks (no target token anywhere: check loss_mask and "
            "attention_mask); no step was taken"
        )
    n_mbs = int(stats[:, 1].max())
    mbs = [mb.data.to(device) for mb in packed]
    mbs += [dummy_micro_batch(pad_token_id, device)] * (n_mbs - len(mbs))
    weights += [0.0] * (n_mbs - len(weights))
    return BatchPlan(mbs, weights, total_weight, int(stats[:, 3].sum()), packed)
