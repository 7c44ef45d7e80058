"""A LoRA adapter published on its own: :class:`AdapterPublisher` (:mod:`~bridge.lora.publisher`) by disk, or on one
host by tensors (:mod:`~bridge.lora.broadcast`)."""

from __future__ import annotations

from bridge import lazy_exports

_EXPORTS = {name: "bridge.lora.publisher" for name in ("AdapterPublishResult", "AdapterPublisher",
                                                         "AdapterPublisherConfig")}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
