"""AdamW and the warmup + constant/linear/cosine learning-rate schedule.

Example:
    >>> import torch
    >>> cfg = OptimizerConfig(lr=1.0, warmup_steps=2, schedule="linear", total_steps=4)
    >>> [lr_factor(cfg, s) for s in range(5)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import OptimizerConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def lr_factor(cfg: OptimizerConfig, step: int) -> float:
    """The multiplier of ``cfg.lr`` for the optimizer step that follows ``step`` successful steps."""
    if step < cfg.warmup_steps:
        # (s + 1), not s: a schedule that starts at lr 0 wastes its first step.
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    assert cfg.total_steps is not None  # OptimizerConfig checks this for decaying schedules
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    r = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return r + (1.0 - r) * (1.0 - progress)
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (plain or FSDP2 DTensor parameters)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig) -> LambdaLR:
    """A LambdaLR following :func:`lr_factor`; call ``step()`` once per successful optimizer step."""
    return LambdaLR(optimizer, _factor_fn(cfg))


def _factor_fn(cfg: OptimizerConfig) -> Callable[[int], float]:
    # A plain function on purpose: LambdaLR.state_dict() stores the __dict__ of callable objects but
    # skips functions, so the checkpoint holds only the step count and the config stays authoritative.
    def factor(step: int) -> float:
        return lr_factor(cfg, step)

    return factor
