"""How a sync's bytes are formed: every tensor (``full``) or what changed since the served base (``delta``).

See :mod:`bridge.encodings.base` for what an encoding does at each step of a sync, and
:mod:`bridge.encodings.delta` for the delta encoding.
"""

from bridge.encodings.base import Encoding, Outgoing, Transfer, gathered
from bridge.encodings.registry import encoding_class, encoding_names, register_encoding

__all__ = ["Encoding", "Outgoing", "Transfer", "encoding_class", "encoding_names", "gathered", "register_encoding"]
