"""How a PEFT LoRA model's parameters are named, and the adapter as PEFT saves it.

``peft.get_peft_model`` renames every parameter: ``base_model.model.`` in front, ``.base_layer`` inside a
targeted linear layer, and the adapter's matrices as ``<layer>.lora_A.<adapter>.weight``. The engine keeps
the HF names for the base weights (so the full sync and checkpoints see the model they know) and
PEFT's saved names for the adapter (``adapter_model.safetensors``: the adapter name taken out).

Example:
    >>> base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> adapter_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
"""

from __future__ import annotations

import enum

__all__ = ["ADAPTER_NAME", "adapter_config_dict", "adapter_name", "base_name", "is_adapter_param", "peft_model"]

ADAPTER_NAME = "default"
"""The PEFT adapter the engine trains (``get_peft_model``'s default name)."""
_PREFIX = "base_model.model."
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def peft_model(model, lora_config):
    """``peft.get_peft_model(model, lora_config)``, without the FutureWarning PEFT causes by reading transformers'
    deprecated ``is_gradient_checkpointing`` (not the user's to act on)."""
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, lora_config)


def is_adapter_param(name: str) -> bool:
    """True for a parameter of the LoRA adapter (not of the frozen base model)."""
    return any(part in name for part in _ADAPTER_PARTS)


def base_name(name: str) -> str:
    """The HF name of a base parameter under PEFT's wrapper (a name without the wrapper is unchanged)."""
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return name.replace(".base_layer.", ".")


def adapter_name(name: str, adapter: str = ADAPTER_NAME) -> str:
    """The name PEFT's ``adapter_model.safetensors`` gives an adapter parameter (the adapter's name taken out)."""
    return name.replace(f".{adapter}.", ".")


def adapter_config_dict(peft_model, adapter: str = ADAPTER_NAME, base_model: str | None = None) -> dict:
    """The adapter's ``adapter_config.json`` as a JSON-ready dict (what ``save_pretrained`` writes).

    Sets become sorted lists and enums their values; ``inference_mode`` is True, as in a saved adapter.
    """
    config = peft_model.peft_config[adapter].to_dict()
    config["inference_mode"] = True
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    return {k: _plain(v) for k, v in config.items()}


def _plain(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
