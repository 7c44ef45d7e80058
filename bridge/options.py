"""A setting declared once: its default, its help and how a command line shows it, read from the field.

Every setting of :class:`bridge.config.PublisherConfig`, of its groups, of a transport's ``Options`` and of an
encoding's ``Options`` is a dataclass field made with :func:`option`; :func:`fields_of` reads them back as
:class:`OptionField` rows, from which ``wsync train`` generates its flags (``wsync/flags.py``) and
``PublisherConfig`` names the owner of an option given to the wrong transport or encoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["NoOptions", "OptionField", "fields_of", "merged_fields", "option"]


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           flag: str | None = None, metavar: str | None = None, many: bool = False,
           choices: Callable[[], list[str]] | tuple[str, ...] | None = None) -> Any:
    """A setting: ``default`` (or ``factory``, whose docstring says the default), and ``help``, what
    ``wsync train --help`` shows for its flag. ``flag``: the flag's name when it is not the field's
    (``server`` for ``servers``); ``many``: the flag repeats, each value one item; ``choices``: the values
    the flag takes (or a function listing them)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "many": many, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """The options of a transport or an encoding that has none of its own."""


@dataclasses.dataclass(frozen=True)
class OptionField:
    """One setting, as a command line shows it."""

    name: str
    type: type
    """``int``, ``float``, ``bool`` or ``str`` (each item's, for a setting that takes several)."""
    default: object
    """The field's default (the value its factory makes, for one with a factory)."""
    default_text: str
    """The default as ``--help`` shows it ("" for None)."""
    help: str
    owners: tuple[str, ...] = ()
    """The transports (or encodings) that declare it; empty for a setting every publisher has."""
    kind: str = ""
    """``transport``, ``encoding`` or "" (a setting every publisher has)."""
    flag: str = ""
    """The command-line flag, without ``--``."""
    many: bool = False
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def transports(self) -> tuple[str, ...]:
        """The transports that declare it (a transport option's owners)."""
        return self.owners if self.kind == "transport" else ()


def fields_of(cls: type, owner: str | None = None, kind: str = "") -> list[OptionField]:
    """The settings of the dataclass ``cls`` (a group, or the ``Options`` of the transport or encoding ``owner``)."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if f.default is not dataclasses.MISSING:
            default, text = f.default, "" if f.default is None else _shown(f.default)
        else:
            default = f.default_factory()
            text = (f.default_factory.__doc__ or "").strip() or _shown(default)
        choices = meta.get("choices")
        choices = tuple(choices() if callable(choices) else choices) if choices else None
        out.append(OptionField(
            f.name, _base_type(f.type), default, text, meta.get("help", ""), (owner,) if owner else (), kind,
            meta.get("flag") or f.name.replace("_", "-"), bool(meta.get("many")), meta.get("metavar"), choices))
    return out


def merged_fields(per_owner) -> list[OptionField]:
    """The fields of each owner's options (an iterable of :func:`fields_of` lists), once per name, the owners
    that declare one name together, in the order they are declared."""
    out: dict[str, OptionField] = {}
    for fields in per_owner:
        for f in fields:
            seen = out.get(f.name)
            out[f.name] = f if seen is None else dataclasses.replace(seen, owners=(*seen.owners, *f.owners))
    return list(out.values())


def _shown(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else ""
    return str(value)


def _base_type(annotation) -> type:
    """``str`` for ``"str | None"`` and the like (fields are annotated as strings under ``from __future__``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    first = text.split("|")[0].strip()
    return {"int": int, "float": float, "bool": bool}.get(first, str)
