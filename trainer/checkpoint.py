"""Checkpoints of the FSDP2 engine: HF safetensors (loadable by ``from_pretrained``) or DCP.

``save(engine, path)`` and ``load(engine, path)`` are collectives, called through
:meth:`trainer.FSDPEngine.save` / :meth:`~trainer.FSDPEngine.load`. ``"hf"``: rank 0 writes (or reads)
safetensors shards, config, generation config and tokenizer, plus with ``with_optim`` the full
optimizer and scheduler state in ``optimizer.pt``; the others receive by broadcast. ``"dcp"``: every
rank writes its own shards with ``torch.distributed.checkpoint`` (a filesystem all ranks share).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.publisher.agreement import Agreement

__all__ = ["WEIGHT_FORMATS", "load", "save"]

logger = get_logger(__name__)

WEIGHT_FORMATS = ("hf", "dcp")
_OPTIM_FILE = "optimizer.pt"  # HF format: full optimizer + scheduler state, written by rank 0
_MAX_SHARD_SIZE = "5GB"  # safetensors shard size, as transformers' save_pretrained
CHECKPOINT_IO_S = 3600.0
"""How long the other ranks wait for rank 0 to write or read an HF checkpoint."""


def save(engine, path: str | os.PathLike, weight_format: str = "hf", with_optim: bool = False) -> None:
    """Write the weights (and optionally optimizer + schedule state) to ``path``; a collective.

    ``"hf"``: rank 0 writes safetensors shards, config, generation config and tokenizer, loadable by
    ``AutoModelForCausalLM.from_pretrained`` (tied heads are not stored), and with ``with_optim``
    the full optimizer and scheduler state to ``optimizer.pt``. ``"dcp"``: every rank writes its
    shards with ``torch.distributed.checkpoint`` (needs a filesystem all ranks share).
    """
    _check_format(weight_format)
    path = Path(path)
    if weight_format == "dcp":
        state = {"model": get_model_state_dict(engine.model)}
        if with_optim:
            state["optim"] = get_optimizer_state_dict(engine.model, engine.optimizer)
            state["extra"] = {"scheduler": engine.lr_scheduler.state_dict(), "step": engine.global_step}
        dcp.save(state, checkpoint_id=str(path))
        dist.barrier()
        return

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(engine.model, options=full)  # {} on ranks other than 0
    optim = get_optimizer_state_dict(engine.model, engine.optimizer, options=full) if with_optim else None

    def write() -> None:
        path.mkdir(parents=True, exist_ok=True)
        tied = engine.tied_names  # (input, output): the head is the embedding, stored once
        if tied is not None:
            weights.pop(tied[1], None)
        _write_safetensors(weights, path)
        engine.model_config.save_pretrained(path)
        if engine.generation_config is not None:
            engine.generation_config.save_pretrained(path)
        if engine.tokenizer is not None:
            engine.tokenizer.save_pretrained(path)
        if with_optim:
            torch.save(
                {"optimizer": optim, "scheduler": engine.lr_scheduler.state_dict(), "step": engine.global_step},
                path / _OPTIM_FILE,
            )

    _on_rank0(engine, write, what=f"saving to {path}")
    if engine.rank == 0:
        logger.info("saved %s checkpoint to %s (optimizer: %s)", weight_format, path, with_optim)

def load(engine, path: str | os.PathLike, weight_format: str = "hf", with_optim: bool = False) -> None:
    """Load what :meth:`save` wrote (in place, bit-exact); a collective.

    Raises:
        ConfigError: the path does not exist, misses files, or holds weights of another model.
    """
    _check_format(weight_format)
    path = Path(path)
    if weight_format == "dcp":
        _load_dcp(engine, path, with_optim)
        return

    expected = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    loaded: dict = {}

    def read() -> None:
        if not path.is_dir():
            raise ConfigError(f"checkpoint {str(path)!r} does not exist (or is not a directory)")
        weights = _read_safetensors(path)
        tied = engine.tied_names  # (input, output): the head was left out; it is the embedding
        if tied is not None and tied[1] not in weights:
            weights[tied[1]] = weights.get(tied[0])
        _check_weights(weights, expected, path)
        loaded["weights"] = weights
        if with_optim:
            if not (path / _OPTIM_FILE).is_file():
                raise ConfigError(f"{path} has no {_OPTIM_FILE}; it was saved without with_optim=True")
            loaded.update(torch.load(path / _OPTIM_FILE, map_location="cpu", weights_only=True))

    _on_rank0(engine, read, what=f"reading {path}")
    from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(engine.model, loaded.get("weights", {}), options=from_rank0)
    if with_optim:
        _set_optim_state(engine, loaded.get("optimizer", {}), options=from_rank0)
        extra = [{"scheduler": loaded.get("scheduler"), "step": loaded.get("step")}]
        dist.broadcast_object_list(extra, src=0)
        engine.lr_scheduler.load_state_dict(extra[0]["scheduler"])
        engine.global_step = extra[0]["step"]
    if engine.rank == 0:
        logger.info("loaded hf checkpoint from %s (optimizer: %s)", path, with_optim)

def _load_dcp(engine, path: Path, with_optim: bool) -> None:
    missing = torch.tensor([0 if (path / ".metadata").is_file() else 1], device=engine.device)
    dist.all_reduce(missing)  # every rank reads DCP files: agree before the collective load
    if int(missing):
        raise ConfigError(f"DCP checkpoint {str(path)!r} does not exist on every rank (no .metadata)")
    state = {"model": get_model_state_dict(engine.model)}
    if with_optim:
        state["optim"] = get_optimizer_state_dict(engine.model, engine.optimizer)
        state["extra"] = {"scheduler": engine.lr_scheduler.state_dict(), "step": engine.global_step}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(engine.model, state["model"])
    if with_optim:
        _set_optim_state(engine, state["optim"])
        engine.lr_scheduler.load_state_dict(state["extra"]["scheduler"])
        engine.global_step = state["extra"]["step"]

def _set_optim_state(engine, state: dict, options: StateDictOptions | None = None) -> None:
    set_optimizer_state_dict(engine.model, engine.optimizer, state, options=options)
    # Serialisation turns the betas tuple into a list; keep param_groups exactly as AdamW builds them.
    for group in engine.optimizer.param_groups:
        group["betas"] = tuple(group["betas"])


def _on_rank0(engine, fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0; its error, of any type, is raised on every rank (:mod:`bridge.publisher.agreement`,
    the same agreement a weight sync uses), instead of leaving the other ranks waiting."""
    Agreement.of_default_group().step(what, lambda: fn() if engine.rank == 0 else None, timeout=CHECKPOINT_IO_S)


def _check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight_format {weight_format!r}; use one of {', '.join(WEIGHT_FORMATS)}")


def _write_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``weights`` as safetensors shards (+ index when more than one), like save_pretrained."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(weights, max_shard_size=_MAX_SHARD_SIZE)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: weights[n].contiguous() for n in names}, str(path / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                 "weight_map": split.tensor_to_filename}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint {str(path)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f), device="cpu"))
    return weights


def _check_weights(weights: dict, expected: dict[str, tuple[int, ...]], path: Path) -> None:
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ConfigError(
            f"checkpoint {str(path)!r} lacks {len(missing)} parameter(s) of this model, e.g. {missing[:3]}; "
            "was it written for another model?"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ConfigError(
                f"checkpoint {str(path)!r}: {name} has shape {tuple(weights[name].shape)}, the model expects {shape}"
            )
