"""LoRA adapters on the reference server: SGLang's ``--enable-lora`` serving, merge-free, swapped atomically.

An adapter is a PEFT LoRA adapter (its ``adapter_config.json`` and its ``lora_A``/``lora_B`` tensors), loaded
by name from a PEFT adapter directory (``/load_lora_adapter``) or from tensors
(``/load_lora_adapter_from_tensors``), and picked per generation by ``lora_path`` (its name) in ``/generate``.

Serving is merge-free: the base model is never changed. Each ``nn.Linear`` gets a forward hook (at start, with
``--enable-lora``) that
adds ``lora_B(lora_A(x)) * scaling`` for the adapter of the generation computing on this thread (a
thread-local), with PEFT's own operations in PEFT's order (the input cast to the adapter's dtype, the sum cast
back), so the answer is PEFT's ``PeftModel`` answer bit for bit; generations with different adapters, or
none, run side by side. Base weight updates change nothing here (the adapter tensors are kept apart).

A swap is atomic. An :class:`Adapter` is built completely (config parsed by PEFT's ``LoraConfig``, every
tensor checked and copied) before it is published under its name, by one assignment under a lock; a
generation takes the adapter object when it starts and computes with that object to its end (so it never
sees half of a load, and reports the version it ran on), and a failed load publishes nothing, leaving the
previous adapter of that name serving. Loading a name that is loaded is refused as SGLang refuses it
("already loaded") unless the body asks ``wsync_replace: true`` (a project field; SGLang ignores it): the
new adapter then replaces the old one at once, with no moment where the name is missing. Unload removes the
name; generations already running with it finish on it (SGLang waits for them instead).

Versions: the project field ``wsync_lora_version`` on a load body labels the adapter (default ``"default"``);
every generation with an adapter reports ``meta_info.wsync_lora_version``, the version it ran on. SGLang has no
adapter version.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from bridge.digest import tensor_checksum
from bridge.protocol import VERSION_GOES_BACK
from inference_adapter.checks import RunClaim, version_number
from inference_adapter.errors import RequestError

__all__ = ["LORA_DISABLED", "Adapter", "ServedAdapters", "adapter_from_dir", "build_adapter", "parse_lora_paths",
           "preload", "using"]

LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's refusal of every adapter route on a server started without ``--enable-lora``."""

_PEFT_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_local = threading.local()


@dataclass(frozen=True, eq=False)
class Adapter:
    """One built adapter; never changed after it is published (a new load builds a new one)."""

    name: str
    version: str
    path: str
    pinned: bool
    run_id: str | None
    """The ``wsync_run_id`` of the load (None: none given)."""
    rank: int
    config: dict
    tensors: dict[str, torch.Tensor]
    """The adapter's tensors by the name they came with (PEFT's ``base_model.model.<module>.lora_A.weight``)."""
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(repr=False)
    """``module path -> (lora_A weight, lora_B weight, scaling)``."""


def _lora_config(config_dict: dict, name: str):
    """PEFT's ``LoraConfig`` of an adapter_config, or a RequestError naming what PEFT or this server refuses."""
    from peft import LoraConfig

    if not isinstance(config_dict, dict):
        raise RequestError(f"LoRA adapter {name}: config_dict must be the PEFT adapter_config object")
    if config_dict.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"LoRA adapter {name}: peft_type {config_dict.get('peft_type')!r} is not LORA")
    known = set(LoraConfig.__dataclass_fields__)
    try:
        cfg = LoraConfig(**{k: v for k, v in config_dict.items() if k in known and k != "peft_type"})
    except Exception as e:  # a boundary: whatever the config holds, the answer is a 400 naming it
        raise RequestError(f"LoRA adapter {name}: PEFT refuses its config ({e})") from None
    if isinstance(cfg.r, bool) or not isinstance(cfg.r, int) or cfg.r < 1 or isinstance(cfg.lora_alpha, bool) \
            or not isinstance(cfg.lora_alpha, (int, float)) or not math.isfinite(cfg.lora_alpha):
        raise RequestError(f"LoRA adapter {name}: r must be a positive integer and lora_alpha a finite number, got "
                           f"r={cfg.r!r}, lora_alpha={cfg.lora_alpha!r}")
    tm = cfg.target_modules
    if not (isinstance(tm, str) or (isinstance(tm, (list, set, tuple)) and tm and all(isinstance(m, str) for m in tm))):
        raise RequestError(f"LoRA adapter {name}: target_modules must be module-name suffixes or a regex (PEFT's "
                           f"adapter_config), got {tm!r}")
    unsupported = [(cfg.use_dora, "DoRA adapters"), (bool(cfg.modules_to_save), "modules_to_save"),
                   (cfg.bias != "none", f"bias={cfg.bias!r}"), (bool(cfg.rank_pattern), "rank_pattern"),
                   (bool(cfg.alpha_pattern), "alpha_pattern")]
    for bad, what in unsupported:
        if bad:
            raise RequestError(f"Failed to load {name} because LoRA serving currently doesn't support {what}; "
                               "save a plain LoRA adapter (lora_A/lora_B on Linear modules)")
    return cfg


class ServedAdapters:
    """The adapters a server serves, by name, and the forward hooks that apply them.

    ``enabled`` (``--enable-lora``), ``max_rank`` (``--max-lora-rank``), ``max_loaded`` (``--max-loaded-loras``:
    beyond it the least recently used unpinned adapter is unloaded, as SGLang does), ``target_modules``
    (``--lora-target-modules``: module-name suffixes an adapter may touch; None or ``all``: any Linear).
    """

    def __init__(self, model: torch.nn.Module, *, enabled: bool = False, max_rank: int = 64,
                 max_loaded: int | None = None, target_modules: list[str] | None = None):
        self.model, self.enabled, self.max_rank, self.max_loaded = model, enabled, int(max_rank), max_loaded
        self.target_modules = None if not target_modules or "all" in target_modules else set(target_modules)
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if enabled:  # every Linear at once: a hook registered while generations compute would race their forwards
            for n, m in self._linears.items():
                m.register_forward_hook(_make_hook(n))
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, Adapter] = OrderedDict()

    # ------------------------------------------------------------------ reads

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def listing(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> path (``__tensor__`` for one loaded from tensors)."""
        with self._lock:
            return {n: a.path for n, a in self._by_name.items()}

    def acquire(self, name: str) -> Adapter:
        """The adapter a generation asking for ``name`` runs with (SGLang's refusal if none)."""
        self.require_enabled()
        with self._lock:
            a = self._by_name.get(name)
            if a is None:
                raise RequestError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                   f"Loaded adapters: {list(self._by_name)}.")
            self._by_name.move_to_end(name)
            return a

    def checksums(self, name: str) -> dict:
        """``{"lora_name", "wsync_lora_version", "checksums": {tensor name: sha256}, "dtypes"}`` of one adapter."""
        self.require_enabled()
        with self._lock:
            a = self._by_name.get(name)
        if a is None:
            raise RequestError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.names()}")
        return {"lora_name": a.name, "wsync_lora_version": a.version,
                "checksums": {n: tensor_checksum(t) for n, t in a.tensors.items()},
                "dtypes": {n: str(t.dtype).removeprefix("torch.") for n, t in a.tensors.items()}}

    # ------------------------------------------------------------------ changes

    def load(self, adapter: Adapter, replace: bool, run: RunClaim | None = None, allow_rollback: bool = False) -> dict:
        """Publish a built adapter under its name; SGLang's refusals (already loaded, unless ``replace``), and the
        weights' version rule: a replacement older than the served version of that name is refused unless the
        load starts a new run (:class:`~inference_adapter.checks.RunClaim`) or ``allow_rollback``."""
        with self._lock:
            old = self._by_name.get(adapter.name)
            if old is not None and not replace:
                raise RequestError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded; "
                                   "unload it first, or send wsync_replace=true to replace it atomically")
            if old is not None and not allow_rollback and not (run or RunClaim()).starts_new_run(old.run_id):
                was, now = version_number(old.version), version_number(adapter.version)
                if was is not None and now is not None and now < was:
                    raise RequestError(
                        f"Failed to load LoRA adapter {adapter.name}: wsync_lora_version {adapter.version} is older "
                        f"than the served version {old.version}; a restarted trainer must not replace a newer adapter. "
                        "To start a new run, send wsync_new_run=true or a wsync_run_id other than the served one's",
                        reason=VERSION_GOES_BACK)
            self._by_name[adapter.name] = adapter
            self._by_name.move_to_end(adapter.name)
            while self.max_loaded is not None and len(self._by_name) > self.max_loaded:
                lru = next((n for n, a in self._by_name.items() if not a.pinned and n != adapter.name), None)
                if lru is None:
                    break
                del self._by_name[lru]
            return {n: a.path for n, a in self._by_name.items()}

    def unload(self, name: str) -> dict:
        self.require_enabled()
        with self._lock:
            if name not in self._by_name:
                raise RequestError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self._by_name)}")
            del self._by_name[name]
            return {n: a.path for n, a in self._by_name.items()}

    def require_enabled(self) -> None:
        if not self.enabled:
            raise RequestError(LORA_DISABLED)

    # ------------------------------------------------------------------ building

    def build(self, name: str, config_dict: dict, tensors: dict[str, torch.Tensor], *, version: str, path: str,
              pinned: bool, run_id: str | None = None) -> Adapter:
        """A complete, checked :class:`Adapter` (nothing published); RequestError naming what is wrong."""
        self.require_enabled()
        cfg = _lora_config(config_dict, name)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            module = _module_of(key)
            if module is None:
                raise RequestError(f"LoRA adapter {name}: tensor {key!r} is not a lora_A/lora_B weight of a module "
                                   f"(expected '{_PEFT_PREFIX}<module>.lora_A.weight'); the reference server serves "
                                   "LoRA on Linear modules only")
            pairs.setdefault(module, {})[key[-len(_SUFFIXES[0]) + 1:].split(".")[0]] = t
        if not pairs:
            raise RequestError(f"LoRA adapter {name}: no lora_A/lora_B tensors were sent")
        checked = _all_finite(list(tensors.values()))  # one pass over the adapter's buffer; else tensor by tensor
        modules = {m: self._module(name, m, ab, cfg, checked) for m, ab in sorted(pairs.items())}
        ranks = {int(a.shape[0]) for a, _, _ in modules.values()}
        rank = max(ranks)
        if rank > self.max_rank or cfg.r > self.max_rank:
            raise RequestError(
                f"LoRA adapter {name} with rank {max(rank, cfg.r)} is incompatible with the current LoRA memory pool "
                f"configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                f"({self.max_rank}) and that the target modules are included in `--lora-target-modules`.")
        return Adapter(name=name, version=str(version), path=path, pinned=bool(pinned), run_id=run_id, rank=rank,
                       config=dict(config_dict), tensors={k: t for k, t in tensors.items()}, modules=modules)

    def _module(self, name: str, module: str, ab: dict[str, torch.Tensor], cfg, finite: bool = False) -> tuple:
        lin = self._linears.get(module)
        if lin is None:
            raise RequestError(f"LoRA adapter {name}: {module!r} is not a Linear module of the served model "
                               f"({type(self.model).__name__}); train the adapter on this model")
        if self.target_modules is not None and module.rsplit(".", 1)[-1] not in self.target_modules:
            raise RequestError(
                f"LoRA adapter '{name}' contains target modules [{module.rsplit('.', 1)[-1]!r}] that are not included "
                f"in the specified --lora-target-modules {sorted(self.target_modules)}. Please update "
                "--lora-target-modules to include all required modules, or use 'all' to enable all supported modules.")
        from peft.tuners.tuners_utils import check_target_module_exists

        if not check_target_module_exists(cfg, module):
            raise RequestError(f"LoRA adapter {name}: tensors for {module!r}, which its config's target_modules "
                               f"{cfg.target_modules!r} does not name; send the config the adapter was trained with")
        if set(ab) != {"lora_A", "lora_B"}:
            raise RequestError(f"LoRA adapter {name}: module {module!r} has {sorted(ab)}, needs lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        for what, t in (("lora_A", a), ("lora_B", b)):
            if t.dtype not in _FLOAT_DTYPES or t.dim() != 2:
                raise RequestError(f"LoRA adapter {name}: {module}.{what} is {t.dtype} {list(t.shape)}; send 2-D "
                                   "float32, bfloat16 or float16 tensors")
            if not finite and not _finite(t):
                raise RequestError(f"LoRA adapter {name}: {module}.{what} holds NaN or Inf")
        r = int(a.shape[0])
        if r != cfg.r:
            raise RequestError(f"LoRA adapter {name}: {module}.lora_A has rank {r}, its config says r={cfg.r}")
        if list(a.shape) != [r, lin.in_features] or list(b.shape) != [lin.out_features, r] or a.dtype != b.dtype:
            raise RequestError(f"LoRA adapter {name}: {module} has lora_A {list(a.shape)} {a.dtype} and lora_B "
                               f"{list(b.shape)} {b.dtype}; this model's module needs [r, {lin.in_features}] and "
                               f"[{lin.out_features}, r] of one dtype")
        scaling = cfg.lora_alpha / (math.sqrt(r) if cfg.use_rslora else r)
        return a, b, scaling


def _finite(t: torch.Tensor) -> bool:
    """No NaN and no Inf in ``t``: its min and max are finite (``aminmax`` propagates NaN; faster than
    ``isfinite(t).all()`` in bfloat16)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor is shown finite in one pass: float tensors of one dtype that fill one span of one
    storage (:func:`~inference_adapter.tensor_payload.tiled_span`, an adapter gathered flat and copied in one
    piece); False otherwise, and then each tensor is checked by itself (which names the one that is not)."""
    from inference_adapter.tensor_payload import tiled_span

    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= set(_FLOAT_DTYPES):
        return False
    span = tiled_span(tensors)
    if span is None:
        return False
    size = tensors[0].element_size()
    flat = torch.empty(0, dtype=tensors[0].dtype).set_(tensors[0].untyped_storage(), span[0] // size,
                                                       ((span[1] - span[0]) // size,))
    return _finite(flat)


def _module_of(key: str) -> str | None:
    """``model.layers.0.self_attn.q_proj`` of ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if not isinstance(key, str) or not key.endswith(_SUFFIXES):
        return None
    return key.removeprefix(_PEFT_PREFIX)[: -len(_SUFFIXES[0])] or None


def _make_hook(path: str):
    def hook(module, args, result):
        adapter = getattr(_local, "adapter", None)
        if adapter is None:
            return None
        ab = adapter.modules.get(path)
        if ab is None:
            return None
        a, b, scaling = ab
        x = args[0]
        x = x if x.dtype == a.dtype else x.to(a.dtype)
        # PEFT's LoRA Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling (dropout is the identity in
        # eval), then cast back to the base layer's dtype.
        out = result + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling
        return out.to(result.dtype)

    return hook


@contextmanager
def using(adapter: Adapter | None) -> Iterator[None]:
    """Run this thread's forwards with ``adapter`` (or none)."""
    prev = getattr(_local, "adapter", None)
    _local.adapter = adapter
    try:
        yield
    finally:
        _local.adapter = prev


_MAX_CONFIG_BYTES = 1 << 20


def adapter_from_dir(path: str, name: str, roots: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of a PEFT adapter directory (``save_pretrained``'s output).

    As a disk weight update: the directory, symlinks resolved, must lie under one of ``roots`` (``--disk-root``),
    and each file must be a regular file directly inside it (opened without blocking: a FIFO never freezes the
    server)."""
    from safetensors.torch import load as load_safetensors

    from bridge.errors import SnapshotError
    from bridge.snapshot.manifest import open_entry, under_roots

    try:
        real = os.path.realpath(path)
        is_dir = os.path.isdir(real)
    except (ValueError, OSError) as e:  # an embedded NUL byte, a name too long
        raise RequestError(f"LoRA adapter {name}: lora_path {path!r} is not a usable path ({e})") from None
    if not is_dir:
        raise RequestError(f"LoRA adapter {name}: {path} is not a directory; give a PEFT adapter directory "
                           "(adapter_config.json and adapter_model.safetensors)")
    if not under_roots(real, roots):
        raise RequestError(f"LoRA adapter {name}: {path} (resolved: {real}) is outside the directories this server "
                           f"loads from ({', '.join(roots)}); start the server with --disk-root naming it")
    data: dict = {}
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            fd = open_entry(real, f)
        except FileNotFoundError:
            raise RequestError(f"LoRA adapter {name}: {path} has no {f}; save the adapter with PEFT's "
                               "save_pretrained (safetensors)") from None
        except SnapshotError as e:
            raise RequestError(f"LoRA adapter {name}: {e}") from None
        with os.fdopen(fd, "rb") as fh:
            data[f] = fh.read(_MAX_CONFIG_BYTES + 1) if f.endswith(".json") else _read_all(fh)
    try:
        if len(data["adapter_config.json"]) > _MAX_CONFIG_BYTES:
            raise ValueError(f"adapter_config.json is over {_MAX_CONFIG_BYTES} bytes")
        config = json.loads(data["adapter_config.json"])
        raw = data["adapter_model.safetensors"]
        tensors = _safetensors_views(raw)
        if tensors is None:  # anything but a plain file: safetensors' own loader, which names what is wrong
            tensors = load_safetensors(bytes(raw))
    except Exception as e:  # a boundary: whatever the files hold, the answer is a 400 naming it
        raise RequestError(f"LoRA adapter {name}: {path} does not load ({type(e).__name__}: {e})") from None
    return config, tensors


def _read_all(fh) -> bytearray:
    """The whole file into one writable buffer (the tensors become views of it, :func:`_safetensors_views`)."""
    size = os.fstat(fh.fileno()).st_size
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = fh.readinto(view[got:])
        if not n:
            break
        got += n
    view.release()
    if got < size:  # the file shrank while it was read: what was there
        del buf[got:]
    else:
        buf += fh.read()  # (or grew)
    return buf


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_MAX_HEADER = 100 << 20


def _safetensors_views(raw: bytearray) -> dict[str, torch.Tensor] | None:
    """The tensors of a plain safetensors file as views of its bytes (no copy; they fill one buffer, so the
    adapter is checked in one pass): float tensors whose data fill the file's data region side by side, at offsets
    that suit their dtype. None for anything else, which safetensors' own loader then reads (or refuses)."""
    if len(raw) < 8:
        return None
    n = int.from_bytes(raw[:8], "little")
    base = 8 + n
    if n > min(_MAX_HEADER, len(raw) - 8):
        return None
    try:
        header = json.loads(bytes(raw[8:base]))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    entries = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            return None
        dtype, shape, offsets = _ST_DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None, e["shape"], e["data_offsets"]
        if dtype is None or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) \
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            return None
        start, end = offsets
        if end - start != math.prod(shape) * dtype.itemsize or (base + start) % dtype.itemsize:
            return None
        entries.append((start, end, name, dtype, shape))
    entries.sort(key=lambda x: (x[0], x[1]))
    pos = 0
    for start, end, *_ in entries:
        if start != pos:
            return None
        pos = end
    if pos != len(raw) - base:
        return None
    flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return {name: flat[base + start : base + end].view(dtype).view(shape) for start, end, name, dtype, shape in entries}


def parse_lora_paths(items: list[str]) -> list[tuple[str, str, bool]]:
    """SGLang's ``--lora-paths`` items as ``(name, path, pinned)``: ``name=path``, ``path`` (named by itself), or
    the JSON object ``{"lora_name", "lora_path", "pinned"}``; ValueError naming a bad one."""
    out = []
    for raw in items:
        item = raw.strip()
        if item.startswith("{") and item.endswith("}"):
            try:
                obj = json.loads(item)
                out.append((str(obj["lora_name"]), str(obj["lora_path"]), bool(obj.get("pinned", False))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-paths {raw!r}: a JSON item needs 'lora_name' and 'lora_path' ({e})") from None
        else:
            name, _, path = item.partition("=")
            out.append((name, path, False) if path else (item, item, False))
    return out


def preload(adapters: ServedAdapters, items: list[tuple[str, str, bool]]) -> None:
    """Load ``--lora-paths`` at start (version ``"default"``); the operator named each directory, so it is its
    own root. RequestError naming the first that does not load."""
    for name, path, pinned in items:
        root = os.path.realpath(path)
        config, tensors = adapter_from_dir(path, name, [root])
        adapters.load(build_adapter(adapters, name, config, tensors, version=None, path=path, pinned=pinned),
                      replace=False)


def build_adapter(adapters: ServedAdapters, name: str, config: dict, tensors: dict, *, version: str | None,
                  path: str, pinned: bool, run_id: str | None = None) -> Adapter:
    """:meth:`ServedAdapters.build` with the version defaulted."""
    return adapters.build(name, config, tensors, version=version if version is not None else "default", path=path,
                          pinned=pinned, run_id=run_id)
