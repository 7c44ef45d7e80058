"""The trainer wing: an FSDP2 engine for Hugging Face causal LMs that feeds weight syncs.

Public API:
    FSDPEngine       build, shard, train (``train_batch``), save/load (HF or DCP), and hand out full
                     tensors one at a time for a sync (``param_specs``, ``iter_full_tensors``).
    EngineConfig     which model, sharding options, micro-batch budget, seed, optimizer.
    OptimizerConfig  AdamW, gradient clipping and the warmup + constant/linear/cosine schedule.
    LoraConfig       a PEFT LoRA adapter trained on frozen base weights (``EngineConfig(lora=...)``).
    next_token_loss  the default loss (mean next-token cross entropy over ``loss_mask``);
    loss_token_count its default weight (the number of target tokens).
"""

from trainer.config import EngineConfig, LoraConfig, OptimizerConfig
from trainer.data import loss_token_count, next_token_loss
from trainer.engine import FSDPEngine

__all__ = ["EngineConfig", "FSDPEngine", "LoraConfig", "OptimizerConfig", "loss_token_count", "next_token_loss"]
