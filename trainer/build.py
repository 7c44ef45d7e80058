"""What ``FSDPEngine.initialize()`` does before the optimizer exists: check, join, load, shard.

Each step is a function of the config alone, run identically on every rank:

- :func:`check_model_dir`: a local causal-LM directory, or a :class:`ConfigError` saying what is wrong
  with it (checked before the process group is joined, so a wrong path fails fast on every rank);
- :func:`join_process_group`: the device this rank computes on and the FSDP mesh over the default
  process group (created here, and owned by the engine, when the caller has not initialised one);
- :func:`load_model`: the model in float32 master weights and its tokenizer, from the directory or a
  preset;
- :func:`apply_lora`: with ``EngineConfig(lora=...)``, the PEFT LoRA wrapper (before sharding): the base
  weights frozen, the adapter's matrices the only trainable parameters;
- :func:`shard_model`: ``fully_shard`` on each decoder layer and then on the root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from bridge.errors import ConfigError
from bridge.log import get_logger
from bridge.process_group import find_free_port
from bridge.tensors import dtype_from_str
from trainer.config import EngineConfig

__all__ = ["Placement", "apply_lora", "check_model_dir", "join_process_group", "load_model", "load_tokenizer", "shard_model"]

logger = get_logger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where this rank trains: its device, the FSDP mesh, and whether it created the default process group
    (then the engine destroys it at the end)."""

    device: torch.device
    mesh: DeviceMesh
    owns_process_group: bool


def check_model_dir(path: str):
    """The transformers config of a local causal-LM directory, or a ConfigError saying what is wrong."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    p = Path(path)
    fix = "give a local Hugging Face causal-LM directory (as written by save_pretrained) or use preset="
    if not p.exists():
        raise ConfigError(f"model_path {path!r} does not exist; {fix}")
    if not p.is_dir():
        raise ConfigError(f"model_path {path!r} is a file, not a model directory; {fix}")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model_path {path!r} has no config.json, so it is not a Hugging Face model directory; {fix}")
    try:
        config = AutoConfig.from_pretrained(p)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model_path {path!r}: config.json is not a transformers config ({e}); {fix}") from None
    archs = list(getattr(config, "architectures", None) or [])
    causal_arch = not archs or any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or not causal_arch:
        raise ConfigError(
            f"model_path {path!r} holds a {config.model_type!r} model ({', '.join(archs) or 'no architectures'}), "
            f"which is not a causal language model; {fix}"
        )
    if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
        raise ConfigError(f"model_path {path!r} has a config but no weights (*.safetensors); {fix}")
    return config


def join_process_group(init_timeout: float) -> Placement:
    """Pick this rank's device (CUDA exactly when available) and join the default process group.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) the group uses its env:// rendezvous; a plain
    ``python script.py`` gets a world of one, so the same code runs without torchrun. An already
    initialised group is used as it is.
    """
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        kwargs = dict(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=init_timeout))
        if cuda:
            kwargs["device_id"] = device
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(**kwargs)
        else:
            port = find_free_port()
            dist.init_process_group(**kwargs, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    return Placement(device, mesh, owns)


def load_model(cfg: EngineConfig, hf_config) -> tuple[torch.nn.Module, object]:
    """The model (float32 master weights, on the CPU, not yet sharded) and its tokenizer (None if absent).

    ``hf_config`` is what :func:`check_model_dir` returned for ``cfg.model_path``; unused for a preset.
    """
    if cfg.model_path is None:
        from bridge.local.presets import build_model, build_tokenizer

        return build_model(cfg.preset, cfg.seed), build_tokenizer()
    from transformers import AutoModelForCausalLM

    # Master weights are float32 whatever the checkpoint holds; MixedPrecisionPolicy casts for compute.
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, config=hf_config, dtype=torch.float32)
    return model, load_tokenizer(cfg.model_path)


def load_tokenizer(path: str):
    """The directory's tokenizer, or None (with a warning: saved checkpoints will not include one)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        logger.warning("no tokenizer in %s (%s); saved checkpoints will not include one", path, e)
        return None


def apply_lora(model: torch.nn.Module, cfg: EngineConfig) -> torch.nn.Module:
    """The model wrapped by ``peft.get_peft_model`` with ``cfg.lora`` (unchanged when ``cfg.lora`` is None).

    PEFT freezes every base parameter and adds ``lora_A``/``lora_B`` beside each targeted linear layer;
    it runs before ``fully_shard`` so that the adapter's matrices are sharded with their layer.

    Raises:
        ConfigError: no module of the model matches ``target_modules``.
    """
    if cfg.lora is None:
        return model
    from trainer.lora import peft_model

    try:
        return peft_model(model, cfg.lora.peft_config())
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"lora.target_modules {list(cfg.lora.target_modules)} match no layer of the model ({e}); "
            f"its linear layers are {', '.join(linear)}"
        ) from None


def shard_model(model: torch.nn.Module, cfg: EngineConfig, placement: Placement) -> None:
    """``fully_shard`` every decoder layer, then the root, with the config's precision and offload policies."""
    mp = MixedPrecisionPolicy(param_dtype=dtype_from_str(cfg.param_dtype), reduce_dtype=torch.float32)
    # Pinned memory needs an accelerator; on CPU the offload policy only keeps what is already there.
    pin = placement.device.type == "cuda"
    offload = CPUOffloadPolicy(pin_memory=pin) if cfg.cpu_offload else OffloadPolicy()
    # The decoder layers are what transformers refuses to split across devices: each becomes one
    # FSDP unit, so only one layer is unsharded at a time. What is left (embeddings, norm, head)
    # belongs to the root unit, which keeps tied embeddings in one place.
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        logger.warning("%s names no decoder layers (_no_split_modules); sharding it as one unit", type(model).__name__)
    for block in blocks:
        fully_shard(block, mesh=placement.mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=placement.mesh, mp_policy=mp, offload_policy=offload)
