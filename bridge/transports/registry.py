"""Which transports exist: each registers itself, and every list of transports is read from here.

A transport module decorates its :class:`~bridge.transports.base.Transport` subclass with
:func:`register`; the class says its ``name``, its ``aliases``, its ``Options`` (a dataclass checked in
its own ``__post_init__``) and what it needs from a weight source. ``PublisherConfig``, ``wsync train``'s
``--publish`` choices and option flags, the demo and the fault matrix all ask :func:`transport_names` and
:func:`transport_class`, so a new transport is one new module and nothing else changes.

Modules outside the project register the same way once imported: name them in ``WSYNC_PLUGINS``
(comma-separated module names), or declare an entry point in the ``wsync.transports`` group of their
package; both are imported the first time the registry is asked.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from bridge.errors import ConfigError
from bridge.options import OptionField, fields_of, merged_fields

if TYPE_CHECKING:
    from bridge.transports.base import Transport

__all__ = ["OptionField", "option_fields", "register", "transport_class", "transport_names"]

BUILTIN = ("bridge.transports.broadcast", "bridge.transports.colocated", "bridge.transports.disk")
"""The project's own transports, in the order they are listed."""

PLUGINS_ENV = "WSYNC_PLUGINS"
ENTRY_POINT_GROUP = "wsync.transports"

_classes: dict[str, type[Transport]] = {}
_aliases: dict[str, str] = {}
_loaded = False


def register(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make ``cls`` the transport called ``cls.name`` (and each of ``cls.aliases``)."""
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier() or name == "none":
        raise ConfigError(f"{cls.__qualname__}.name must be an identifier other than 'none', got {name!r}")
    for key in (name, *cls.aliases):
        owner = _classes.get(_aliases.get(key, key))
        if owner is not None and owner.__qualname__ != cls.__qualname__:
            raise ConfigError(f"transport name {key!r} of {cls.__qualname__} is taken by {owner.__qualname__}")
    _classes[name] = cls
    _aliases.update({alias: name for alias in cls.aliases})
    return cls


def transport_names() -> list[str]:
    """Every registered transport: the project's own first, then the plugins in the order they registered."""
    _load()
    builtin = {module: i for i, module in enumerate(BUILTIN)}
    # sorted is stable: plugins keep their registration order after the project's own, whichever module
    # happened to import a built-in transport first
    return sorted(_classes, key=lambda name: builtin.get(_classes[name].__module__, len(BUILTIN)))


def transport_class(name: str) -> type[Transport]:
    """The class of the transport called ``name`` or one of its aliases; a ConfigError naming the known ones."""
    _load()
    cls = _classes.get(_aliases.get(name, name))
    if cls is None:
        aliases = ", ".join(f"{a!r} for {n!r}" for a, n in _aliases.items())
        raise ConfigError(
            f"unknown transport {name!r}: the transports are {', '.join(map(repr, transport_names()))}"
            + (f" (aliases: {aliases})" if aliases else "")
            + f"; a transport of your own registers itself when its module is imported ({PLUGINS_ENV}=module)"
        )
    return cls


def option_fields() -> list[OptionField]:
    """Every transport option, once per name (an option two transports share lists both in ``owners``), in
    the order the transports declare them. ``help`` comes from each field's ``metadata["help"]``."""
    return merged_fields(fields_of(_classes[name].Options, name, "transport") for name in transport_names())


def _load() -> None:
    """Import the built-in transports, then the plugins (once all of them imported; a failure is raised
    again at the next call, never half-remembered)."""
    global _loaded
    if _loaded:
        return
    for module in (*BUILTIN, *(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"cannot import transport module {module!r} (named in {PLUGINS_ENV}?): {e}") from e
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # name the plugin: its own traceback would not say it was loaded as one
            raise ConfigError(f"cannot load transport plugin {ep.name!r} ({ep.value}): {e}") from e
    _loaded = True
