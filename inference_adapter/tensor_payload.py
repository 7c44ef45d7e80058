"""SGLang's own ``/update_weights_from_tensor`` payload with same-host CPU tensors, unpickled as SGLang 0.5.23 does.

An entry of ``serialized_named_tensors`` is base64 of SGLang's ``MultiprocessingSerializer`` output (torch's
``ForkingPickler``): with no ``load_format`` a list of ``(name, tensor)`` pairs (a tensor may be SGLang's
``LocalSerializedTensor``, whose ``values[tp_rank]`` is itself such a payload), with ``"flattened_bucket"`` the
dict ``{"flattened_tensor": <1-D uint8 tensor>, "metadata": [FlattenedTensorMetadata, ...]}``. A CPU tensor
pickles as a handle to its shared memory, not its bytes: with torch's ``file_system`` sharing strategy the
name of a shared-memory file (``rebuild_storage_filename``), which any process on the host may open.

SGLang 0.5.23 unpickles it with ``SafeUnpickler`` (``srt/utils/common.py``): only the globals of its
``ALLOWED_GLOBALS`` are looked up, and ``torch.storage._load_from_bytes`` is replaced by a ``weights_only``
``torch.load``. :data:`SGLANG_ALLOWED_GLOBALS` is that list (``tests/test_colocated.py`` compares it with SGLang's
source); :class:`_Unpickler` looks up nothing outside it, answering SGLang's own words, ``Blocked unsafe global
(module.name) during pickle deserialization``. Inside it, a few entries cannot serve a CPU server's weight
update and are refused by name instead of being looked up (:data:`_NOT_HERE`): CUDA and NPU tensors (IPC
handles of a device this server does not have), torch's ``file_descriptor`` strategy (its ``DupFd`` handle
connects back to the sender's ``multiprocessing`` resource sharer, which admits only processes sharing the
sender's authentication key, so an HTTP server cannot open it; the trainer sets
``torch.multiprocessing.set_sharing_strategy("file_system")``), and SGLang's request and multimodal structs, which
are no weights. SGLang's own weight-sync classes are looked up as plain records of the same fields (this server
does not import SGLang). Every refusal carries ``wsync_reason`` :data:`bridge.protocol.PICKLE_REFUSED`.

The tensors are copied out of shared memory before the answer (the trainer frees them once answered) and
checked like any bucket (names, shapes, dtypes, finiteness) by the caller.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

import torch

from bridge.protocol import PICKLE_REFUSED

__all__ = ["SGLANG_ALLOWED_GLOBALS", "PayloadRefused", "adapter_tensors", "copied", "named_tensors", "tiled_span"]


def _globals(spec: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset((module, name) for module, names in spec.items() for name in names.split())


_TENSOR_TYPES = "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor IntTensor LongTensor ShortTensor"
_STORAGE_TYPES = ("BFloat16Storage BoolStorage ByteStorage CharStorage ComplexDoubleStorage ComplexFloatStorage "
                  "DoubleStorage FloatStorage HalfStorage IntStorage LongStorage ShortStorage")

SGLANG_ALLOWED_GLOBALS = _globals({
    "_codecs": "encode",
    "builtins": "bool bytearray bytes complex dict float frozenset int list range set slice str tuple",
    "collections": "Counter OrderedDict defaultdict deque",
    "copyreg": "__newobj__ __newobj_ex__",
    "functools": "partial",
    "itertools": "chain repeat",
    "multiprocessing.reduction": "_rebuild_partial _rebuild_socket",
    "multiprocessing.resource_sharer": "DupFd",
    "types": "SimpleNamespace",
    "sglang.srt.disaggregation.encoder.receiver": "EmbeddingData",
    "sglang.srt.managers.io_struct": "EmbeddingReqInput GenerateReqInput",
    "sglang.srt.managers.schedule_batch": "Modality",
    "sglang.srt.multimodal.modality": "Modality",
    "sglang.srt.model_executor.model_runner": "LocalSerializedTensor",
    "sglang.srt.model_executor.model_runner_components.weight_updater": "LocalSerializedTensor",
    "sglang.srt.utils.patch_torch": "_rebuild_cuda_tensor_modified _rebuild_npu_tensor_modified",
    "sglang.srt.weight_sync.tensor_bucket": "FlattenedTensorBucket FlattenedTensorMetadata",
    "torch": (
        f"BoolTensor Tensor Size UntypedStorage device dtype {_TENSOR_TYPES} {_STORAGE_TYPES} QInt32Storage "
        "QInt8Storage QUInt2x4Storage QUInt4x2Storage QUInt8Storage bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 "
        "bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 complex64 double float float16 float32 "
        "float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int "
        "int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long per_channel_affine "
        "per_channel_affine_float_qparams per_channel_symmetric per_tensor_affine per_tensor_symmetric qint32 qint8 "
        "quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
    ),
    "torch._tensor": "_rebuild_from_type_v2",
    "torch._utils": (
        "_rebuild_device_tensor_from_cpu_tensor _rebuild_device_tensor_from_numpy _rebuild_meta_tensor_no_storage "
        "_rebuild_parameter _rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor _rebuild_tensor "
        "_rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_wrapper_subclass"
    ),
    "torch.cuda": f"BoolTensor {_TENSOR_TYPES} {_STORAGE_TYPES}",
    "torch.cuda.sparse": _TENSOR_TYPES,
    "torch.multiprocessing.reductions": (
        "rebuild_cuda_tensor rebuild_meta_tensor rebuild_nested_tensor rebuild_sparse_compressed_tensor "
        "rebuild_sparse_coo_tensor rebuild_storage_empty rebuild_storage_fd rebuild_storage_filename rebuild_tensor "
        "rebuild_typed_storage rebuild_typed_storage_child"
    ),
    "torch.nn.parameter": "Parameter",
    "torch.serialization": "_get_layout",
    "torch.sparse": _TENSOR_TYPES,
    "torch.storage": "TypedStorage UntypedStorage _UntypedStorage",
    "torch_npu.multiprocessing.reductions": "rebuild_npu_tensor",
})
"""SGLang 0.5.23's ``SafeUnpickler.ALLOWED_GLOBALS``, entry for entry."""

_CUDA = ("a CUDA (or NPU) tensor, an IPC handle of device memory; the reference server runs on CPU: send CPU "
         "tensors (shared memory), or send CUDA tensors to a real SGLang server on that GPU")
_FD = ("a tensor shared with torch's file_descriptor strategy, whose handle only the sender's multiprocessing "
       "children can open; call torch.multiprocessing.set_sharing_strategy('file_system') in the sending process")
_NO_WEIGHTS = "an SGLang request or multimodal struct, which is no part of a weight payload"


def _not_here() -> dict[tuple[str, str], str]:
    out = {g: _CUDA for g in SGLANG_ALLOWED_GLOBALS if g[0].startswith(("torch.cuda", "torch_npu"))}
    out.update({("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _CUDA,
                ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _CUDA,
                ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified"): _CUDA,
                ("multiprocessing.resource_sharer", "DupFd"): _FD,
                ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _FD,
                ("multiprocessing.reduction", "_rebuild_socket"): _NO_WEIGHTS})
    out.update({g: _NO_WEIGHTS for g in SGLANG_ALLOWED_GLOBALS if g[1] in
                ("EmbeddingData", "EmbeddingReqInput", "GenerateReqInput", "Modality")})
    return out


_NOT_HERE = _not_here()
"""Allowed by SGLang, refused here by name: what each cannot be on this CPU server."""


class PayloadRefused(Exception):
    """The payload cannot be taken; ``str()`` says why and what to send instead."""

    reason = PICKLE_REFUSED


class _Record:
    """SGLang's weight-sync dataclasses, as plain records: unpickling sets their fields."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class FlattenedTensorMetadata(_Record):
    """SGLang's ``FlattenedTensorMetadata``: ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``."""


class FlattenedTensorBucket(_Record):
    """SGLang's ``FlattenedTensorBucket`` (its fields only)."""


class LocalSerializedTensor(_Record):
    """SGLang's ``LocalSerializedTensor``: ``values[tp_rank]`` is one rank's serialized tensor."""


_RECORDS = {"FlattenedTensorMetadata": FlattenedTensorMetadata, "FlattenedTensorBucket": FlattenedTensorBucket,
            "LocalSerializedTensor": LocalSerializedTensor}


def _safe_load_torch_storage(data: bytes):
    """SGLang's replacement for ``torch.storage._load_from_bytes``: a ``weights_only`` load that must give a storage."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _safe_load_torch_storage
        if (module, name) not in SGLANG_ALLOWED_GLOBALS:
            raise PayloadRefused(f"Blocked unsafe global ({module}.{name}) during pickle deserialization (as SGLang "
                                 "0.5.23's SafeUnpickler blocks it); send SGLang's MultiprocessingSerializer output of "
                                 "tensors only")
        if (module, name) in _NOT_HERE:
            raise PayloadRefused(f"the payload holds {module}.{name}: {_NOT_HERE[(module, name)]}")
        if module.startswith("sglang."):
            return _RECORDS[name]
        return super().find_class(module, name)


def _unpickle(entry: str | bytes) -> object:
    """One entry as SGLang's ``normalize_serialized_named_tensor_payload`` + ``MultiprocessingSerializer.deserialize``."""
    try:
        data = base64.b64decode(entry, validate=True) if isinstance(entry, str) else bytes(entry)
    except (binascii.Error, ValueError) as e:
        raise PayloadRefused(f"the entry is not base64 ({e}); send MultiprocessingSerializer.serialize(..., "
                             "output_str=True)") from None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except PayloadRefused:
        raise
    except Exception as e:
        raise PayloadRefused(f"the entry is not a MultiprocessingSerializer payload this host can open "
                             f"({type(e).__name__}: {e}); the sender must be on this host and keep its tensors "
                             "alive until the server answers") from None


def _cpu_tensor(t, what: str) -> torch.Tensor:
    if isinstance(t, LocalSerializedTensor):
        values = getattr(t, "values", None)
        if not isinstance(values, list) or not values:
            raise PayloadRefused(f"{what} is a LocalSerializedTensor without values")
        t = _unpickle(values[0])  # this server is TP rank 0 of 1
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_quantized:
        raise PayloadRefused(f"{what} is {type(t).__name__}, not a dense tensor")
    if t.device.type != "cpu":
        raise PayloadRefused(f"{what} is on {t.device}: {_CUDA}")
    return t


def _flattened(payload) -> list[tuple[str, torch.Tensor]]:
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` of the flattened dict, bounds checked."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise PayloadRefused("with load_format 'flattened_bucket' the entry must be the dict {'flattened_tensor', "
                             "'metadata'} of SGLang's FlattenedTensorBucket")
    flat = _cpu_tensor(payload["flattened_tensor"], "flattened_tensor").reshape(-1)
    if flat.dtype != torch.uint8:
        raise PayloadRefused(f"flattened_tensor is {flat.dtype}, not uint8")
    out = []
    for m in payload["metadata"] if isinstance(payload["metadata"], list) else [None]:
        if not isinstance(m, FlattenedTensorMetadata):
            raise PayloadRefused("metadata must be a list of SGLang's FlattenedTensorMetadata")
        shape, dtype, start, end = getattr(m, "shape", None), getattr(m, "dtype", None), m.start_idx, m.end_idx
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, (tuple, list)):
            raise PayloadRefused(f"metadata of {m.name!r} has no torch dtype and shape")
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= flat.numel()
                and end - start == nbytes):
            raise PayloadRefused(f"metadata of {m.name!r} spans bytes {start}..{end} of {flat.numel()}, but "
                                 f"{list(shape)} {dtype} takes {nbytes}")
        out.append((m.name, flat[start:end].view(dtype).reshape(shape)))
    return out


def named_tensors(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one entry (``load_format`` None or ``"flattened_bucket"``), copied out of
    the sender's shared memory; PayloadRefused names what was wrong."""
    payload = _unpickle(entry)
    if load_format == "flattened_bucket":
        pairs = _flattened(payload)
    else:
        if not isinstance(payload, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                              for p in payload):
            raise PayloadRefused("with no load_format the entry must be a list of (name, tensor) pairs")
        pairs = [(n, _cpu_tensor(t, f"tensor {n!r}")) for n, t in payload]
    if not all(isinstance(n, str) for n, _ in pairs):
        raise PayloadRefused("a tensor name is not a string")
    return [(n, t.clone()) for n, t in pairs]


def adapter_tensors(entry: str | bytes, load_format: str | None) -> dict[str, torch.Tensor]:
    """The tensors of one ``/load_lora_adapter_from_tensors`` entry, copied out of the sender's shared memory.

    SGLang's ``TpModelWorker.load_lora_adapter_from_tensors``: with ``"flattened_bucket"`` the flattened dict,
    else the unpickled object itself, which SGLang's ``Engine`` makes a dict ``{name: tensor}`` (a list of
    ``(name, tensor)`` pairs, 0.5.8's ``serialized_tensors``, is taken too). Tensors that fill one buffer (the
    trainer's flat gather) are copied in one copy of it (:func:`copied`)."""
    if load_format == "flattened_bucket":
        items = _flattened(_unpickle(entry))
    elif load_format is not None:
        raise PayloadRefused(f"load_format {load_format!r} is not one of None, 'flattened_bucket'")
    else:
        payload = _unpickle(entry)
        if isinstance(payload, dict):
            items = list(payload.items())
        elif isinstance(payload, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in payload):
            items = [tuple(p) for p in payload]
        else:
            raise PayloadRefused("with no load_format the entry must be a dict {name: tensor} (SGLang's Engine sends "
                                 "MultiprocessingSerializer.serialize(dict))")
        if not all(isinstance(n, str) for n, _ in items):
            raise PayloadRefused("a tensor name is not a string")
        items = [(n, _cpu_tensor(t, f"tensor {n!r}")) for n, t in items]
    if not all(isinstance(n, str) for n, _ in items):
        raise PayloadRefused("a tensor name is not a string")
    return copied(items)


def tiled_span(tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """``(start, end)``, in bytes, of the span of one storage that ``tensors`` fill exactly: each contiguous and
    not empty, side by side with no gap and no overlap (an adapter gathered flat, in any order); None otherwise."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    spans = []
    for t in tensors:
        if t.numel() == 0 or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        start = t.storage_offset() * t.element_size()
        spans.append((start, start + t.numel() * t.element_size()))
    spans.sort()
    if any(a_end != b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])) or spans[-1][1] > storage.nbytes():
        return None
    return spans[0][0], spans[-1][1]


def copied(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: a copy of the tensor}``: tensors that fill one span of one storage (:func:`tiled_span`) as views
    of one copy of that span (one copy instead of one per tensor: 224 for a rank-16 adapter of a 16-layer model),
    any others one by one. Only the tensors' own bytes are copied."""
    tensors = [t for _, t in items]
    span = tiled_span(tensors) if len(tensors) > 1 else None
    if span is None or any((t.storage_offset() * t.element_size() - span[0]) % t.element_size() for t in tensors):
        return {n: t.clone() for n, t in items}  # (a view's offset in the copy must suit its dtype)
    start, end = span
    buf = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage(), start, (end - start,)).clone()
    out = {}
    for n, t in items:
        off = t.storage_offset() * t.element_size() - start
        out[n] = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out
