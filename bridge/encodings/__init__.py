"""How a sync's bytes are formed: every tensor (``full``), what changed since the served base (``delta``), or
every tensor with the projections as block FP8 (``fp8``).

See :mod:`bridge.encodings.base` for what an encoding does at each step of a sync, :mod:`bridge.encodings.delta`
for the delta encoding and :mod:`bridge.encodings.fp8` for the FP8 one.
"""

from bridge.encodings.base import Encoding, Outgoing, Transfer, gathered
from bridge.encodings.registry import encoding_class, encoding_names, register_encoding

__all__ = ["Encoding", "Outgoing", "Transfer", "encoding_class", "encoding_names", "gathered", "register_encoding"]
