"""Real SGLang's co-located payload: one bucket as SGLang's flattened bucket of CUDA IPC handles.

SGLang's ``/update_weights_from_tensor`` takes ``serialized_named_tensors``, one entry per TP rank of the
server; TP rank ``r`` deserializes entry ``r`` only (``TpModelWorker.deserialize_own_rank`` in 0.5.23,
``serialized_named_tensors[self.tp_rank]`` in 0.5.6) with ``MultiprocessingSerializer.deserialize`` (a
restricted unpickler). With ``load_format="flattened_bucket"`` (SGLang >= 0.5.6) the entry is the dict
``{"flattened_tensor": <1-D uint8 tensor>, "metadata": [FlattenedTensorMetadata, ...]}`` and the model
runner rebuilds the named tensors with ``FlattenedTensorBucket(...).reconstruct_tensors()``; without a
load format the entry is a list of ``(name, tensor)`` pairs. This is what colocated RL frameworks (verl,
slime) send, and :func:`serialize_bucket` builds it with SGLang's own code, imported from the trainer
host's SGLang installation: ``FlattenedTensorMetadata``/``FlattenedTensorBucket`` around the bucket
buffer the trainer gathered (no copy: the metadata are the bucket's offsets) and
``MultiprocessingSerializer.serialize(..., output_str=True)``, once per TP rank as SGLang's own
``Engine`` does, so that each rank's CUDA IPC reference is released when that rank drops it.

A CUDA tensor pickles as a CUDA IPC handle of its allocation (torch's ``reduce_tensor``); nothing is
copied. The device is written as its UUID (SGLang's ``monkey_patch_torch_reductions``, applied only while
the entries are built and undone afterwards, unless the process had applied it already), because the
server's processes number their visible GPUs differently from the trainer. The buffer must stay alive
until every server answered; torch's IPC reference counting keeps its memory from being reused while a
server still holds it.

Only SGLang >= 0.5.6 on both sides: the pickle names SGLang's module paths
(``sglang.srt.utils.patch_torch``, ``sglang.srt.weight_sync.tensor_bucket``), which older releases lack.

Checked by SGLang's own code on CPU (``tests/test_cuda_ipc.py``, CPU tensors, which pickle as shared
memory instead of IPC handles); the CUDA IPC path itself has not yet run on a GPU.

Example (a CPU host with SGLang importable; on a GPU host ``buf`` is a CUDA tensor):
    >>> import torch                                                       # doctest: +SKIP
    >>> from bridge.buckets import flatten_tensors, plan_buckets           # doctest: +SKIP
    >>> from bridge.tensors import ParamSpec                               # doctest: +SKIP
    >>> bucket = plan_buckets([ParamSpec("w", (2, 2), torch.bfloat16)], 1 << 20)[0]      # doctest: +SKIP
    >>> entries = serialize_bucket(bucket, flatten_tensors(bucket, {"w": torch.ones(2, 2)}), tp_size=2)  # doctest: +SKIP
    >>> len(entries), type(entries[0]).__name__                            # doctest: +SKIP
    (2, 'str')
"""

from __future__ import annotations

import contextlib
import types

import torch

from bridge.buckets import Bucket, unflatten_bucket
from bridge.errors import ConfigError

__all__ = ["FLATTENED", "MIN_RELEASE", "serialize_bucket", "sglang_code"]

FLATTENED = "flattened_bucket"
MIN_RELEASE = (0, 5, 6)
"""The first SGLang release with flattened buckets and the module paths the payload names."""


def sglang_code() -> types.SimpleNamespace:
    """SGLang's classes the payload is built with, from this host's SGLang installation.

    Raises:
        ConfigError: SGLang is not importable here, or is older than 0.5.6.
    """
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except ImportError as e:
        raise ConfigError(
            "the colocated transport builds real SGLang's CUDA IPC payload with SGLang's own serializer, so the "
            f"trainer host needs SGLang >= {'.'.join(map(str, MIN_RELEASE))} importable (pip install the server's "
            f"SGLang version in the trainer's environment): {e}"
        ) from e
    return types.SimpleNamespace(
        MultiprocessingSerializer=MultiprocessingSerializer, FlattenedTensorBucket=FlattenedTensorBucket,
        FlattenedTensorMetadata=FlattenedTensorMetadata, monkey_patch_torch_reductions=monkey_patch_torch_reductions,
    )


def serialize_bucket(bucket: Bucket, buf: torch.Tensor, tp_size: int, flattened: bool = True) -> list[str]:
    """SGLang's ``serialized_named_tensors`` for one bucket: ``tp_size`` base64 strings, one per TP rank.

    ``buf`` is the bucket's 1-D uint8 buffer in :mod:`bridge.buckets` layout, on the trainer's CUDA device
    (a CPU buffer serializes too, as shared memory: how the CPU tests check the format). ``flattened``:
    SGLang's ``load_format="flattened_bucket"`` dict; else a list of ``(name, tensor)`` views
    (``load_format=None``). Keep ``buf`` alive until the server answered.

    Raises:
        ConfigError: ``buf`` does not match the bucket, ``tp_size`` < 1, or SGLang is not importable.
    """
    if tp_size < 1:
        raise ConfigError(f"tp_size must be at least 1, got {tp_size}")
    named = unflatten_bucket(buf, bucket.specs)  # checks the buffer against the layout
    sg = sglang_code()
    if flattened:
        metadata = [
            sg.FlattenedTensorMetadata(name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=o,
                                       end_idx=o + s.nbytes, numel=s.nbytes)
            for s, o in zip(bucket.specs, bucket.offsets)
        ]
        fb = sg.FlattenedTensorBucket(flattened_tensor=buf, metadata=metadata)
        payload = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
    else:
        payload = named
    if buf.is_cuda:
        # The copy kernels that filled the buffer must have finished before a server reads it.
        torch.cuda.current_stream(buf.device).synchronize()
    with _device_uuids(sg.monkey_patch_torch_reductions, buf.is_cuda):
        return [sg.MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(tp_size)]


@contextlib.contextmanager
def _device_uuids(patch, cuda: bool):
    """While entries are built: CUDA tensors pickle with their device's UUID (SGLang's patch of torch's
    reductions, which its receiving side expects). Undone afterwards, because the patched reduction fails on
    every CPU tensor (DataLoader workers forked later would inherit it), unless the process had applied it
    itself (verl and slime do), in which case it is left as it was."""
    from torch.multiprocessing import reductions

    if not cuda or hasattr(reductions, "_reduce_tensor_original"):
        yield
        return
    patch()
    try:
        yield
    finally:
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()
