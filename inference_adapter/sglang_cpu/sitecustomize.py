"""Real SGLang on a CPU host (see README.md beside this file): pinned memory needs an accelerator, so where
there is none ``pin_memory=True`` is dropped from torch's tensor constructors and ``Tensor.pin_memory()``
returns the tensor itself. Python runs this at start-up in every process with this folder on PYTHONPATH."""

import functools


def _unpinned() -> None:
    import torch

    if torch.cuda.is_available() or torch.accelerator.is_available():
        return

    def drop_pin(fn):
        @functools.wraps(fn)
        def wrapper(*args, pin_memory=False, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    for name in ("tensor", "empty", "zeros", "ones", "full", "empty_strided", "as_tensor", "arange"):
        setattr(torch, name, drop_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


_unpinned()
