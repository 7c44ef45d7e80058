"""The check before any byte moves: do the servers serve the model the trainer is about to send?

Rank 0 runs it right after the prepare step (step "check"), once the fleet found the servers and the encoding
planned what travels (``Plan.buckets``: a quantized encoding's dtypes and scales), before any is paused, so a
mistake costs a few requests instead of a whole broadcast, a snapshot, or a 120 s wait for a load that
never comes. The reference server lists what it serves (``/wsync/weights_spec``): every tensor's name,
shape and dtype is compared, and every difference is named in full, with the fix. Real SGLang lists no
parameters: its serving dtype is compared where its server info states one, and what its
``/get_weights_by_name`` route can tell is asked in a bounded number of requests
(:mod:`bridge.publisher.preflight_sglang`: names, trailing dims, the layer count), once per server; what it cannot
tell is said once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from bridge.errors import ConfigError
from bridge.publisher.preflight_sglang import sglang_mismatch
from bridge.tensors import ParamSpec, dtype_to_str

__all__ = ["check_servers_serve", "mismatch"]

_FIX = "start the server with the trainer's model, or publish to servers of this model"
# The real SGLang servers whose model was asked and found to match (a server back after the fleet excluded
# it gets a new client, so it is asked again).
_matched: weakref.WeakSet = weakref.WeakSet()


def check_servers_serve(specs: Sequence[ParamSpec], clients: Sequence, serving_dtype: str) -> None:
    """Raise one ConfigError naming every server whose model differs from ``specs`` (the tensors as they
    will travel: HF names, full shapes, wire dtypes), each difference and the fix."""
    problems = []
    for c in clients:
        spec = c.weights_spec()
        if spec is None:
            why = _sglang(specs, c, serving_dtype)
        else:
            why = mismatch(specs, spec, serving_dtype)
        if why:
            problems.append(f"{c.url}: {why}")
    if problems:
        raise ConfigError("the servers do not serve the trainer's model, nothing was sent: " + "; ".join(problems))


def _sglang(specs: Sequence[ParamSpec], c, serving_dtype: str) -> str | None:
    """Why real SGLang at ``c`` cannot take ``specs``, as far as its server info and routes tell, or None."""
    served = c.can.served_dtype
    if served is not None and served != serving_dtype:
        return (f"it serves {served} but serving_dtype={serving_dtype!r}; set serving_dtype={served!r} "
                f"(wsync train --serving-dtype {served})")
    if c in _matched:
        return None
    why = sglang_mismatch(specs, c)
    if why:
        return f"it serves another model: {why}; {_FIX}"
    _matched.add(c)
    return None


def mismatch(specs: Sequence[ParamSpec], spec: dict, serving_dtype: str) -> str | None:
    """Why a server serving ``spec`` (its ``/wsync/weights_spec``) cannot take ``specs``, or None."""
    sent_fp8 = any(dtype_to_str(s.dtype) == "float8_e4m3fn" for s in specs)
    served_fp8 = spec.get("quantization") == "fp8"
    if sent_fp8 != served_fp8:
        return ("quantization_mismatch: the trainer sends block FP8 (encoding='fp8') but it serves "
                f"{spec.get('dtype')} unquantized; restart it with --quantization fp8, or publish with the full encoding"
                if sent_fp8 else
                f"quantization_mismatch: it serves block FP8 (--quantization fp8) but the trainer sends "
                f"{dtype_to_str(specs[0].dtype) if specs else serving_dtype}; publish with encoding='fp8' (wsync train "
                "--encoding fp8)")
    params, aliases = spec["params"], spec.get("aliases", {})
    sent = {aliases.get(s.name, s.name): s for s in specs}
    unknown = [s.name for s in specs if aliases.get(s.name, s.name) not in params]
    unsent = [n for n in params if n not in sent]
    shapes = [f"{n!r} is {list(s.shape)} in the trainer, {params[n]['shape']} served"
              for n, s in sent.items() if n in params and list(s.shape) != params[n]["shape"]]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} tensor(s) differ in shape: " + ", ".join(shapes))
    if unknown:
        parts.append(f"the trainer sends {len(unknown)} tensor(s) it does not have: {unknown}")
    if unsent:
        parts.append(f"it serves {len(unsent)} tensor(s) the trainer does not send: {unsent}")
    if parts:
        return f"it serves another model ({spec.get('model_type', 'unknown')}): " + "; ".join(parts) + f"; {_FIX}"
    if spec.get("dtype") and spec["dtype"] != serving_dtype:
        return (f"it serves {spec['dtype']} but serving_dtype={serving_dtype!r}; set serving_dtype={spec['dtype']!r} "
                f"(wsync train --serving-dtype {spec['dtype']})")
    dtypes = [f"{n!r} is sent as {dtype_to_str(s.dtype)}, served as {params[n]['dtype']}"
              for n, s in sent.items() if dtype_to_str(s.dtype) != params[n]["dtype"]]
    if dtypes:
        return "; ".join(dtypes) + f"; set serving_dtype to the served dtype ({params[next(iter(params))]['dtype']})"
    return None
