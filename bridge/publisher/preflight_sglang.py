"""What real SGLang can be asked, before any byte moves, about the model it serves.

Real SGLang lists no parameters; its only route that reads one is ``/get_weights_by_name`` (every release
the client speaks, 0.4.9-0.5.23: body ``{"name", "truncate_size"}``, answer the tensor as float lists cut
to its first ``truncate_size`` rows, one list per replica when ``dp_size`` > 1, HTTP 400 for a name the
model does not know). It takes the trainer's HF names: SGLang's own ``get_weights_by_name`` maps q/k/v and
gate/up onto the stacked ``qkv_proj``/``gate_up_proj``, answers the embedding for a tied ``lm_head``, and
gathers the row-parallel ``o_proj``/``down_proj`` across TP ranks; column-parallel slices keep their
trailing dims. Only some model classes have it (Llama and its kin, Granite, OPT, Exaone4; not Qwen2 or
Qwen3): where it answers no name, nothing more can be asked.

So a bounded number of requests (:data:`MAX_PROBES`, whatever the model's size) checks:

* every name the trainer sends outside the layers (embedding, final norm, head) and every tensor of the
  first layer is known to the served model, and one tensor of the last layer; the same tensor one layer
  further is not (SGLang's Llama loader skips a layer it does not have without a word);
* the trailing dims of each of those (one row is asked) and the full length of 1-D ones (norms: one row
  of floats too);
* a trainer whose head is tied to the embedding (no ``lm_head.weight`` sent) against a server whose head
  is its own: that head would never be updated.

What it cannot check is said once: the first dim of the others (the vocabulary, each projection's output
width), the dtype of each tensor (it answers float32), the layers between the first and the last.
SGLang's loader checks those shapes when the buckets arrive.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from bridge.errors import ServerError, ServerUnreachable
from bridge.log import get_logger
from bridge.tensors import ParamSpec

__all__ = ["MAX_PROBES", "sglang_mismatch"]

logger = get_logger(__name__)

MAX_PROBES = 32  # requests per server, at most (the tied-head check adds one)
_OUTSIDE = 8  # names outside the layers asked, at most
_LAYER = re.compile(r"^(?P<pre>.*\.layers\.)(?P<i>\d+)\.(?P<rest>.+)$")
_said: set[str] = set()


def _once(key: str, msg: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        logger.info(msg, *args)


def probes(specs: Sequence[ParamSpec]) -> list[tuple[str, tuple[int, ...] | None]]:
    """The names to ask, with the shape each must have (None: must not exist): the tensors outside the layers,
    every tensor of the first layer, one of the last and that one a layer further."""
    outside: list[ParamSpec] = []
    layers: dict[tuple[str, int], list[tuple[re.Match, ParamSpec]]] = {}
    for s in specs:
        m = _LAYER.match(s.name)
        if m is None:
            outside.append(s)
        else:
            layers.setdefault((m["pre"], int(m["i"])), []).append((m, s))
    out = [(s.name, tuple(s.shape)) for s in outside[:_OUTSIDE]]
    if layers:
        stacks: dict[str, int] = {}
        for pre, _ in layers:
            stacks[pre] = stacks.get(pre, 0) + 1
        pre = max(stacks, key=stacks.get)  # the decoder's layers (the stack with the most)
        idx = sorted(i for p, i in layers if p == pre)
        first, last = idx[0], idx[-1]
        tail = []
        m, s = layers[(pre, last)][0]
        if last != first:
            tail.append((s.name, tuple(s.shape)))
        tail.append((f"{pre}{last + 1}.{m['rest']}", None))
        room = MAX_PROBES - len(out) - len(tail)
        out += [(s.name, tuple(s.shape)) for _, s in layers[(pre, first)][:room]] + tail
    return out


def _ask(client, name: str, shape: tuple[int, ...] | None):
    """SGLang's answer for ``name`` (one replica's), or None where it knows no such name (HTTP 400)."""
    rows = shape[0] + 1 if shape is not None and len(shape) == 1 else 1  # a 1-D tensor whole, and one more
    try:
        got = client.get_weights_by_name(name, truncate_size=rows)
    except ServerUnreachable:
        raise
    except ServerError as e:
        if e.status == 400:
            return None
        raise
    return got[0] if client.can.dp_size > 1 and isinstance(got, list) and got else got


def answered_dims(got) -> list[int]:
    """The dims a (truncated) answer shows: its row count, then each row's full length, nested."""
    dims = []
    while isinstance(got, list):
        dims.append(len(got))
        if not got:
            break
        got = got[0]
    return dims


def shape_differs(want: tuple[int, ...], dims: list[int], tp: int) -> str | None:
    """The served shape as far as the answer shows it (``*``: not shown), where it differs from ``want``."""
    if len(want) == 1 and len(dims) == 1:
        ok = dims[0] == want[0] or (tp > 1 and dims[0] * tp == want[0])  # a TP-sliced bias answers its slice
        return None if ok else (f"[more than {want[0]}]" if dims[0] > want[0] else str(dims))
    shown = "[" + ", ".join(["*", *map(str, dims[1:])]) + "]" if dims else "[]"
    if len(dims) != len(want):
        return shown
    for w, d in zip(want[1:], dims[1:]):
        if d != w and not (tp > 1 and d * tp == w):
            return shown
    return None


def sglang_mismatch(specs: Sequence[ParamSpec], client) -> str | None:
    """Why real SGLang at ``client`` cannot take ``specs`` as far as ``/get_weights_by_name`` tells, or None."""
    asked = probes(specs)
    tp = client.tp_size
    answers: dict[str, object] = {}
    for name, shape in asked:
        try:
            answers[name] = _ask(client, name, shape)
        except ServerUnreachable:
            raise
        except ServerError as e:  # not a "no such name": the route itself fails here; the loader decides
            _once(f"failed:{client.url}", "%s (real SGLang) cannot be asked about its model (%s); names and shapes "
                  "are checked by its loader when the buckets arrive", client.url, e)
            return None
        if len(answers) == min(2, len(asked)) and all(a is None for a in answers.values()):
            _once(f"silent:{client.url}", "%s (real SGLang) answers /get_weights_by_name for none of %s: its model "
                  "class has no get_weights_by_name (SGLang's Qwen2 and Qwen3 have none) or serves other names; "
                  "names and shapes are checked by its loader when the buckets arrive", client.url, list(answers))
            return None
    _once("unchecked", "real SGLang: %d names checked per server by /get_weights_by_name (the tensors outside the "
          "layers, the first layer's, the last layer's and the absence of the next), with their trailing dims and "
          "1-D lengths; not checked (SGLang answers truncated float32 rows): the first dim of 2-D tensors, each "
          "tensor's dtype, the layers in between, whether its head is tied when the trainer's is not; its loader "
          "checks those when the buckets arrive", len(asked))
    parts = []
    for name, want in asked:
        got = answers[name]
        if want is None:
            if got is not None:
                parts.append(f"it has more layers than the trainer sends ({name!r} exists, the trainer's last "
                             f"layer is {int(_LAYER.match(name)['i']) - 1})")
        elif got is None:
            parts.append(f"{name!r} ({list(want)} in the trainer) is unknown to it")
        else:
            served = shape_differs(want, answered_dims(got), tp)
            if served:
                parts.append(f"{name!r} is {list(want)} in the trainer, {served} served")
    try:
        parts += _untied_head(specs, client, answers)
    except ServerUnreachable:
        raise
    except ServerError as e:
        logger.debug("%s: the head could not be asked (%s)", client.url, e)
    return "; ".join(parts) if parts else None


def _untied_head(specs: Sequence[ParamSpec], client, answers: dict) -> list[str]:
    """A trainer that ties its head to the embedding sends no ``lm_head.weight``; SGLang answers a tied head
    with the embedding's rows, its own head with other ones, which no sync would update."""
    names = {s.name for s in specs}
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    if embed is None or "lm_head.weight" in names:
        return []
    head = _ask(client, "lm_head.weight", None)
    if head is None or head == (answers[embed] if embed in answers else _ask(client, embed, None)):
        return []
    return [f"it serves its own 'lm_head.weight' (untied), which the trainer does not send (its head is tied to "
            f"{embed!r})"]
