"""Logging that says which rank a line comes from.

``setup_logging()``, called once by each command-line entry point, installs one stderr handler whose
lines read ``12:00:01 I [bridge.publisher.core rank 0] message``: the logger's name and the rank (of the
default process group once there is one, else ``RANK``, else ``-``). ``get_logger(__name__)`` is a plain
``logging.getLogger``, so a program that configures logging its own way keeps its own format.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["DEBUG_ENV", "debug_enabled", "fmt_bytes", "get_logger", "progress_bar", "setup_logging"]

DEBUG_ENV = "WSYNC_DEBUG"

_FORMAT = "%(asctime)s %(levelname).1s [%(name)s rank %(rank)s] %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def _rank() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    return os.environ.get("RANK", "-")


def setup_logging(level: str | int | None = None) -> None:
    """Configure the root logger once (level from ``WSYNC_LOG_LEVEL``, default INFO)."""
    level = level or os.environ.get("WSYNC_LOG_LEVEL", "INFO")
    root = logging.getLogger()
    if any(getattr(h, "_wsync", False) for h in root.handlers):
        root.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_RankFilter())
    handler._wsync = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def debug_enabled() -> bool:
    """``--debug`` or ``WSYNC_DEBUG=1``: print tracebacks instead of one-line errors."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, total: int, desc: str):
    """A tqdm bar of ``total`` bytes that appears only after a second (a no-op when not ``enabled``)."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, delay=1.0, leave=False)
