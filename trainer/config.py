"""Configuration of the FSDP2 trainer engine: one dataclass per concern, every field checked on creation.

Example:
    >>> cfg = EngineConfig(preset="tiny", optimizer=OptimizerConfig(lr=1e-4, warmup_steps=10))
    >>> cfg.optimizer.schedule
    'constant'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bridge.errors import ConfigError
from bridge.local.presets import PRESETS
from bridge.tensors import dtype_from_str

__all__ = ["EngineConfig", "LoraConfig", "OptimizerConfig"]

SCHEDULES = ("constant", "linear", "cosine")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every projection of a Qwen2/Llama-style decoder layer: the default LoRA targets."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule.

    The schedule multiplies ``lr`` by a factor that depends on ``s``, the number of successful optimizer
    steps taken so far (0 for the first step):

    - warmup, ``s < warmup_steps``: ``(s + 1) / warmup_steps``, so the first step never uses lr 0;
    - then, with ``p = min(1, (s - warmup_steps) / (total_steps - warmup_steps))``:
      ``constant``: 1; ``linear``: ``r + (1 - r) * (1 - p)``; ``cosine``: ``r + (1 - r) * (1 + cos(pi p)) / 2``,
      where ``r`` is ``min_lr_ratio``.
    """

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every parameter."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW denominator term."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps up to lr."""
    schedule: str = "constant"
    """Shape after warmup: "constant", "linear" or "cosine"."""
    total_steps: int | None = None
    """Total optimizer steps of the run; required by "linear" and "cosine", which decay until it."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of lr (linear and cosine end at lr * min_lr_ratio)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm to this; None or 0 disables clipping (the norm is still reported)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"optimizer.lr must be a positive finite number, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ConfigError(f"optimizer.eps must be > 0, got {self.eps}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optimizer.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "constant":
            if self.total_steps is None:
                raise ConfigError(f"optimizer.schedule={self.schedule!r} decays until total_steps; set total_steps")
            if self.total_steps <= self.warmup_steps:
                raise ConfigError(
                    f"optimizer.total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
                )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(f"optimizer.max_grad_norm must be >= 0 or None, got {self.max_grad_norm}")


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """A PEFT LoRA adapter trained instead of the full weights: the base weights stay frozen and only
    the adapter's ``lora_A``/``lora_B`` matrices are in the optimizer (see ``FSDPEngine.initialize``)."""

    rank: int = 16
    """The adapter's rank ``r``: each targeted ``W`` becomes ``W + (alpha / r) * B @ A`` with ``A`` [r, in]."""
    alpha: float = 32.0
    """PEFT's ``lora_alpha``: the adapter's output is scaled by ``alpha / rank``."""
    target_modules: tuple[str, ...] = LORA_ALL_LINEAR
    """Names of the linear modules that get an adapter (PEFT matches a module whose name ends with one)."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout`` on the adapter's input during training."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            self.target_modules = tuple(m for m in self.target_modules.split(",") if m)
        self.target_modules = tuple(self.target_modules)
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ConfigError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"lora.alpha must be a positive finite number, got {self.alpha!r}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ConfigError(
                f"lora.target_modules must name at least one module (e.g. {','.join(LORA_ALL_LINEAR)}), "
                f"got {self.target_modules!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")

    def peft_config(self):
        """The ``peft.LoraConfig`` of this adapter (a causal LM, no bias terms trained)."""
        import peft

        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                               lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The FSDP2 engine: which model, how it is sharded, and how it is trained."""

    model_path: str | None = None
    """A local Hugging Face model directory (config.json + weights + tokenizer). Exclusive with preset."""
    preset: str | None = None
    """A model built in memory by bridge.local.presets (``bridge.local.presets.PRESETS``: tiny, small, medium, many).
    Exclusive with model_path."""
    param_dtype: str = "float32"
    """Dtype of the parameters during forward/backward (MixedPrecisionPolicy.param_dtype). The sharded
    master weights, the gradient reduction and the optimizer stay in float32."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy)."""
    mb_max_tokens: int = 8192
    """Token budget of one micro-batch, counted with padding (sequences x longest length). A single
    sequence longer than this gets a micro-batch of its own."""
    seed: int = 0
    """Seed of the preset's initial weights and of torch's RNG on every rank."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW, clipping and learning-rate schedule."""
    lora: LoraConfig | None = None
    """Train a PEFT LoRA adapter on frozen base weights instead of the full weights (None: full training)."""
    init_timeout: float = 1800.0
    """Seconds the default process group waits for its peers (rendezvous and every collective)."""

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.preset is None):
            raise ConfigError(
                f"set exactly one of model_path (a local HF directory) or preset ({', '.join(PRESETS)}); "
                f"got model_path={self.model_path!r}, preset={self.preset!r}"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if dtype_from_str(self.param_dtype) not in _FLOAT_DTYPES:
            raise ConfigError(f"param_dtype must be float32, bfloat16 or float16, got {self.param_dtype!r}")
        if self.mb_max_tokens < 1:
            raise ConfigError(f"mb_max_tokens must be >= 1, got {self.mb_max_tokens}")
        if not self.init_timeout > 0:
            raise ConfigError(f"init_timeout must be > 0 seconds, got {self.init_timeout}")
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(f"optimizer must be an OptimizerConfig, got {type(self.optimizer).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ConfigError(f"lora must be a LoraConfig or None, got {type(self.lora).__name__}")
