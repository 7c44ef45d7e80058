"""Which encodings exist: how a sync's bytes are formed, registered by name as the transports are.

An encoding module decorates its :class:`~bridge.encodings.base.Encoding` subclass with
:func:`register_encoding`; ``PublisherConfig(encoding=...)`` and ``wsync train --encoding`` read the names
from here. The project's own: ``full`` (every tensor, every sync), ``delta`` (what changed since the
version the servers serve), ``fp8`` (every tensor, projections as block FP8) and ``fp8_delta`` (the delta over
what FP8 servers serve).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from bridge.errors import ConfigError
from bridge.options import OptionField, fields_of, merged_fields

if TYPE_CHECKING:
    from bridge.encodings.base import Encoding

__all__ = ["encoding_class", "encoding_names", "encoding_option_fields", "register_encoding"]

BUILTIN = ("bridge.encodings.full", "bridge.encodings.delta", "bridge.encodings.fp8", "bridge.encodings.fp8_delta")
"""The project's own encodings, in the order they are listed."""

_classes: dict[str, type[Encoding]] = {}
_loaded = False


def register_encoding(cls: type[Encoding]) -> type[Encoding]:
    """Class decorator: make ``cls`` the encoding called ``cls.name``."""
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"{cls.__qualname__}.name must be an identifier, got {name!r}")
    owner = _classes.get(name)
    if owner is not None and owner.__qualname__ != cls.__qualname__:
        raise ConfigError(f"encoding name {name!r} of {cls.__qualname__} is taken by {owner.__qualname__}")
    _classes[name] = cls
    return cls


def encoding_names() -> list[str]:
    """Every registered encoding, the project's own first."""
    _load()
    return list(_classes)


def encoding_class(name: str) -> type[Encoding]:
    """The class of the encoding called ``name``; a ConfigError naming the known ones."""
    _load()
    cls = _classes.get(name)
    if cls is None:
        raise ConfigError(f"unknown encoding {name!r}: the encodings are {', '.join(map(repr, _classes))}")
    return cls


def encoding_option_fields() -> list[OptionField]:
    """Every encoding option, once per name, with the encodings that declare it (``owners``)."""
    _load()
    return merged_fields(fields_of(cls.Options, name, "encoding") for name, cls in _classes.items())


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in BUILTIN:
            importlib.import_module(module)
        _loaded = True
