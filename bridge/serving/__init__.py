"""What the serving side imports from the bridge: :mod:`~bridge.serving.subscriber` (each announced version, in order)
and :mod:`~bridge.serving.sglang_delta_loader` (the loader real SGLang runs in its schedulers to apply a delta). Light
on purpose: SGLang imports this package in every scheduler."""
