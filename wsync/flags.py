"""The flags of a command that builds a :class:`bridge.PublisherConfig`, generated from its fields.

Every setting (:func:`bridge.config.config_fields`: the top ones, each group's, every transport's and every
encoding's options) is one flag whose help is the field's and whose default is shown from the field; the flag's
own default is None, so a flag left out keeps the field's default (written once, in the field).
:func:`config_keywords` reads them back as ``PublisherConfig`` keywords.
"""

from __future__ import annotations

import argparse

from bridge.options import OptionField

__all__ = ["add_config_flags", "config_keywords", "negatable", "setting_default"]


def _fields() -> list[OptionField]:
    from bridge.config import config_fields

    return config_fields()


def add_config_flags(p: argparse.ArgumentParser, *, rename: dict[str, str] | None = None,
                     none: dict[str, str] | None = None, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting of a publisher (``only``: those settings alone). ``rename``: a flag name instead of the field's (``transport`` ->
    ``publish``); ``none``: a setting whose flag also takes ``none``, its default, which means what the text
    says (``wsync train --publish none``: no publisher)."""
    rename, none = rename or {}, none or {}
    fields = [o for o in _fields() if only is None or o.name in only]
    shared = p.add_argument_group("publishing", "how and where the weights are published (bridge.PublisherConfig)")
    if any(o.kind for o in fields):
        owned = p.add_argument_group("transport and encoding options", "each transport's and encoding's own "
                                     "settings (one of another transport or encoding is refused)")
    for o in fields:
        g = owned if o.kind else shared
        flag = "--" + rename.get(o.name, o.flag)
        where = f"{'/'.join(o.owners)} {o.kind}: " if o.kind else ""
        text = f"{where}{o.help}" + (f" (default: {o.default_text})" if o.default_text else "")
        kw: dict = dict(dest=o.name, default=None, help=text.replace("%", "%%"))
        if o.name in none:
            kw.update(default="none", choices=["none", *(o.choices or ())],
                      help=kw["help"].replace(f"(default: {o.default_text})", f"(default: none, {none[o.name]})"))
        elif o.choices:
            kw["choices"] = list(o.choices)
        if o.type is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if o.many:
            kw["action"] = "append"
        if "choices" not in kw:
            kw["metavar"] = o.metavar or o.type.__name__.upper()
        g.add_argument(flag, type=o.type, **kw)


def setting_default(name: str) -> object:
    """The default of the setting ``name``, as its field declares it (for a command that needs the value itself)."""
    return next(o.default for o in _fields() if o.name == name)


def negatable() -> set[str]:
    """The settings whose flag says False as ``--no-<flag>``."""
    return {o.name for o in _fields() if o.type is bool}


def config_keywords(args: argparse.Namespace) -> dict:
    """The ``PublisherConfig`` keywords the flags gave (a flag left out is not passed, so the field's default
    holds; a flag of another transport or encoding is passed, and refused by ``PublisherConfig`` naming its
    owner)."""
    return {o.name: getattr(args, o.name) for o in _fields() if getattr(args, o.name, None) is not None}
