"""What a weight update must pass beyond SGLang's own checks, none of which needs the served model.

* :func:`version_problem`: a version label that answers or logs could not carry.
* :class:`RunClaim`: the run a request belongs to; without a new run a version may not go back.
* :func:`non_finite_problem`: weights holding NaN or Inf, which would make sampling fail on every request.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inference_adapter.errors import RequestError

__all__ = ["MAX_VERSION_CHARS", "RunClaim", "finite_checker", "join_problems", "non_finite_problem", "version_number",
           "version_problem"]

MAX_VERSION_CHARS = 256


def version_problem(version: str | None, field: str, example: str = "the training step") -> str | None:
    """What is wrong with a weight version label, or None if it is fine (or not given).

    SGLang takes any string; this server also refuses what would break its own answers or logs: an empty
    label, more than :data:`MAX_VERSION_CHARS` characters, control characters, and lone surrogates
    (which JSON can carry in but UTF-8 cannot carry out).
    """
    if version is None:
        return None
    if not version:
        problem = "is empty"
    elif len(version) > MAX_VERSION_CHARS:
        problem = f"has {len(version)} characters, more than {MAX_VERSION_CHARS}"
    elif any("\ud800" <= c <= "\udfff" for c in version):
        problem = "holds a lone UTF-16 surrogate"
    elif not version.isprintable():
        problem = "holds control characters"
    else:
        return None
    shown = version[:40].encode("utf-8", "backslashreplace").decode()
    return f"{field} {shown!r} {problem}; send 1-{MAX_VERSION_CHARS} printable characters, such as {example}"


@dataclass(frozen=True)
class RunClaim:
    """What a weight-changing request says about the run it belongs to (project fields, ignored by SGLang).

    ``wsync_run_id``: the publishing run's identity (e.g. ``experiment/trial``); a run id other than the
    served one starts a new run. ``wsync_new_run``: an explicit reset. Either lets a version go back;
    without them a version older than the served one is refused (a restarted trainer must not replace
    newer weights). Versions are ordered only when both are decimal integers.
    """

    run_id: str | None = None
    new_run: bool = False
    writer: str | None = None
    """``wsync_writer``: the publisher sending the request (one writer at a time, see
    :mod:`inference_adapter.writers`); None for a client that does not name itself."""

    @classmethod
    def from_fields(cls, run_id: object, new_run: object, writer: object = None) -> RunClaim:
        """The claim of a request's ``wsync_run_id``/``wsync_new_run``/``wsync_writer`` values; RequestError naming
        a bad one."""
        for field, value, example in (("wsync_run_id", run_id, "experiment/trial"),
                                      ("wsync_writer", writer, "host:pid:id")):
            if value is not None and not isinstance(value, str):
                raise RequestError(f"{field} must be a string, such as {example}, got {type(value).__name__}")
            problem = version_problem(value, field, example=example)
            if problem:
                raise RequestError(problem)
        if not isinstance(new_run, bool):
            raise RequestError(f"wsync_new_run must be true or false, got {new_run!r}")
        return cls(run_id, new_run, writer)

    def starts_new_run(self, served_run_id: str | None) -> bool:
        """True when this request may replace the served version with any other, older ones included."""
        return self.new_run or (self.run_id is not None and self.run_id != served_run_id)


def version_number(version: str | None) -> int | None:
    """A version label as an integer when it is a decimal one (only those are ordered), else None."""
    return int(version) if version is not None and re.fullmatch(r"[0-9]{1,30}", version) else None


# Exponent bits of IEEE formats: all ones means Inf or NaN. One integer pass, ~4x cheaper than isfinite.
_EXPONENT_MASKS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                   torch.float32: (torch.int32, 0x7F800000)}


_LOW7, _ONES, _HIGH = 0x7F7F7F7F7F7F7F7F, 0x0101010101010101, -0x7F7F7F7F7F7F7F80  # (0x8080808080808080)


def _fp8_has_nan(b: torch.Tensor) -> bool:
    """Whether e4m3fn bytes ``b`` (flat uint8) hold a NaN (low 7 bits all ones), 8 bytes at a time: ``b & 0x7F``
    plus 1 reaches 0x80 in a byte only from 0x7F, and never carries into the next byte (faster than one
    comparison per byte; the ragged ends, off an 8-byte boundary, byte by byte)."""
    skip = min((-b.storage_offset()) % 8, b.numel())
    body = (b.numel() - skip) // 8 * 8
    for edge in (b[:skip], b[skip + body:]):
        if edge.numel() and bool((edge.bitwise_and(0x7F) == 0x7F).any()):
            return True
    if not body:
        return False
    x = b[skip: skip + body].view(torch.int64).bitwise_and(_LOW7)
    return bool(x.add_(_ONES).bitwise_and_(_HIGH).any())


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf."""
    bad = []
    for name, t in tensors.items():
        if not t.is_floating_point() or not t.numel():
            continue
        mask = _EXPONENT_MASKS.get(t.dtype)
        if t.dtype == torch.float8_e4m3fn:  # no Inf; NaN is S.1111.111 (torch.isfinite has no fp8 kernel)
            finite = not _fp8_has_nan(t.reshape(-1).view(torch.uint8))
        elif mask is None:
            finite = bool(torch.isfinite(t).all())
        else:
            int_dtype, bits = mask
            finite = int(t.reshape(-1).view(int_dtype).bitwise_and(bits).max()) != bits
        if not finite:
            bad.append(name)
    return bad


def non_finite_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why ``tensors`` must not be served (some hold NaN or Inf), or None."""
    bad = _non_finite(tensors)
    if not bad:
        return None
    return f"tensor(s) {bad[:4]} hold NaN or Inf values (not finite); refusing weights that would break sampling"


finite_checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsync-finite-check")
"""Where a session's finite checks run, overlapping the next bucket's receive; end_weight_update waits for them."""


def join_problems(problems: list[str], limit: int = 4) -> str:
    """The first ``limit`` problems as one sentence, and how many more there were."""
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more
