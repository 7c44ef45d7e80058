"""Checking a rank's batch, packing it into micro-batches, and the default next-token loss.

A batch is a TensorDict, or a plain mapping of tensors (a dict), whose ``input_ids`` and
``attention_mask`` are ``[B, L]``; padding may sit on either side. A mapping is wrapped into a TensorDict
of batch size ``[B]``, which checks that every tensor has the batch dimension. Every other tensor is
carried along: ``[B, L, ...]`` tensors token by token (``loss_mask``, log-probs, advantages, ...),
``[B, ...]`` tensors row by row. A micro-batch holds whole sequences (never split), right-padded to its
own longest one, so positions always start at 0.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> ids = torch.tensor([[5, 6, 7, 0], [0, 0, 8, 9]])
    >>> mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    >>> mbs = pack_micro_batches(TensorDict(input_ids=ids, attention_mask=mask, batch_size=[2]), max_tokens=4)
    >>> [mb.data["input_ids"].tolist() for mb in mbs]
    [[[5, 6, 7]], [[8, 9]]]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from bridge.errors import ConfigError

__all__ = [
    "MicroBatch",
    "as_batch",
    "dummy_micro_batch",
    "loss_token_count",
    "next_token_loss",
    "pack_micro_batches",
    "validate_batch",
]

REQUIRED_KEYS = ("input_ids", "attention_mask")


@dataclass(slots=True)
class MicroBatch:
    """Whole sequences of one rank's batch, right-padded to the longest of them."""

    data: TensorDict
    """Per-token tensors as ``[b, l]`` (``l`` = longest real length here), per-row tensors as ``[b, ...]``."""
    rows: torch.Tensor
    """``[b]``: the row of the original batch each sequence came from."""
    cols: torch.Tensor
    """``[b, l]``: the original column of each packed token (meaningful where the attention mask is 1)."""

    @property
    def n_tokens(self) -> int:
        return int(self.data["attention_mask"].sum())


def as_batch(batch: TensorDictBase | Mapping[str, torch.Tensor]) -> TensorDictBase:
    """The batch as a TensorDict: a TensorDict as it is, a mapping wrapped with batch size ``[B]``.

    Raises:
        ConfigError: neither, no ``input_ids`` to take ``B`` from, or a tensor without the batch dimension.
    """
    if isinstance(batch, TensorDictBase):
        return batch
    if not isinstance(batch, Mapping):
        raise ConfigError(f"a batch must be a TensorDict or a dict of tensors with input_ids and attention_mask, "
                          f"got {type(batch).__name__}")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim == 0:
        raise ConfigError(f"batch has no input_ids tensor [B, L] (keys present: {sorted(map(str, batch))})")
    try:
        return TensorDict(dict(batch), batch_size=[ids.shape[0]])
    except (RuntimeError, TypeError, ValueError) as e:
        shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for k, v in batch.items()}
        raise ConfigError(f"every batch entry must be a tensor with the {ids.shape[0]} rows of input_ids first; "
                          f"got {shapes}") from e


def validate_batch(batch: TensorDictBase | Mapping[str, torch.Tensor]) -> None:
    """Check the keys and shapes of one rank's batch (a TensorDict or a mapping, see :func:`as_batch`).

    Raises:
        ConfigError: a required key missing, a shape that does not match ``input_ids``, or no tokens at all.
    """
    batch = as_batch(batch)
    for key in REQUIRED_KEYS:
        if key not in batch.keys():
            raise ConfigError(
                f"batch has no {key!r}; a batch needs input_ids and attention_mask of shape [B, L] "
                f"(keys present: {sorted(map(str, batch.keys()))})"
            )
    ids = batch["input_ids"]
    if ids.ndim != 2 or ids.is_floating_point():
        raise ConfigError(f"input_ids must be an integer tensor [B, L], got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ConfigError(f"empty batch: input_ids has shape {tuple(ids.shape)}; give every rank at least one sequence")
    for key in ("attention_mask", "loss_mask"):
        if key in batch.keys() and tuple(batch[key].shape) != tuple(ids.shape):
            raise ConfigError(f"{key} has shape {tuple(batch[key].shape)}, but input_ids has {tuple(ids.shape)}")
    if not bool(batch["attention_mask"].any()):
        raise ConfigError("empty batch: attention_mask is all zeros, so there is no token to train on")


def pack_micro_batches(batch: TensorDictBase | Mapping[str, torch.Tensor], max_tokens: int) -> list[MicroBatch]:
    """Pack the sequences of a validated batch greedily into micro-batches of at most ``max_tokens``.

    A micro-batch costs (sequences x its longest sequence) tokens. Sequences are taken longest first,
    so the first one of a micro-batch fixes its padded length; a sequence longer than ``max_tokens``
    gets one of its own. Rows without any token are dropped.
    """
    batch = as_batch(batch)
    mask = batch["attention_mask"].bool()
    n_rows, n_cols = mask.shape
    lengths = mask.sum(1)
    # For each row: the columns of its real tokens in order, then its padding (left padding included).
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    by_length = torch.argsort(lengths, descending=True, stable=True).tolist()
    lens = lengths.tolist()

    groups: list[list[int]] = []
    current: list[int] = []
    for row in by_length:
        if lens[row] == 0:
            break  # sorted longest first: only empty rows remain
        if current and lens[current[0]] * (len(current) + 1) > max_tokens:
            groups.append(current)
            current = []
        current.append(row)
    if current:
        groups.append(current)

    keys = list(batch.keys(include_nested=True, leaves_only=True))
    out = []
    for group in groups:
        rows = torch.tensor(group, dtype=torch.long, device=mask.device)
        cols = order[rows, : lens[group[0]]]
        fields = {}
        for key in keys:
            value = batch.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if value.ndim >= 2 and tuple(value.shape[:2]) == (n_rows, n_cols):
                picked = value[rows]
                index = cols.view(*cols.shape, *([1] * (value.ndim - 2))).expand(*cols.shape, *value.shape[2:])
                fields[key] = picked.gather(1, index)
            elif value.ndim >= 1 and value.shape[0] == n_rows:
                fields[key] = value[rows]
            else:
                raise ConfigError(
                    f"batch key {key!r} has shape {tuple(value.shape)}; expected [B, L, ...] or [B, ...] "
                    f"with B={n_rows}, L={n_cols}"
                )
        data = TensorDict(batch_size=[len(group)], device=batch.device)
        for key, value in fields.items():
            data.set(key, value)
        out.append(MicroBatch(data=data, rows=rows, cols=cols))
    return out


def dummy_micro_batch(pad_token_id: int, device: torch.device) -> TensorDict:
    """A one-token micro-batch for a rank that ran out of real ones (its loss is multiplied by 0)."""
    # The token is attended to: a fully masked row can produce NaN in attention, and 0 * NaN is NaN.
    return TensorDict(
        input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long, device=device),
        attention_mask=torch.ones((1, 1), dtype=torch.long, device=device),
        batch_size=[1],
        device=device,
    )


def _target_mask(mb: TensorDictBase) -> torch.Tensor:
    """``[b, l-1]``: 1 where token ``t + 1`` is a real token to be predicted from position ``t``."""
    mask = mb["attention_mask"].bool()
    if "loss_mask" in mb.keys():
        mask = mask & mb["loss_mask"].bool()
    return mask[:, 1:]


def next_token_loss(logits: torch.Tensor, mb: TensorDictBase) -> torch.Tensor:
    """Mean next-token cross entropy over the tokens selected by ``loss_mask`` (or ``attention_mask``).

    Token ``t + 1`` counts when it is a real token and ``loss_mask[t + 1]`` is set; the first token of a
    sequence is never a target. A micro-batch without targets returns 0.
    """
    targets = mb["input_ids"][:, 1:]
    mask = _target_mask(mb)
    logits = logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    ce = ce.view_as(targets) * mask
    return ce.sum() / mask.sum().clamp(min=1)


def loss_token_count(mb: TensorDictBase) -> float:
    """The default loss weight: the number of targets :func:`next_token_loss` averages over."""
    return float(_target_mask(mb).sum())
