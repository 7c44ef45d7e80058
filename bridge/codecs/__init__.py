"""Byte formats and the arithmetic behind them, free of any transport or server: block FP8
(:mod:`~bridge.codecs.fp8`), the delta's diff and wire format (:mod:`~bridge.codecs.delta`) and whether a delta is worth
sending (:mod:`~bridge.codecs.delta_cost`). The encodings (:mod:`bridge.encodings`) plan with them."""
