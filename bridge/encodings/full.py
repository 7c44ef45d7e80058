"""The ``full`` encoding: every tensor, every sync (the publisher's own bucket loop)."""

from bridge.encodings.base import Encoding
from bridge.encodings.registry import register_encoding

__all__ = ["FullEncoding"]


@register_encoding
class FullEncoding(Encoding):
    name = "full"
