"""A version label never names two sets of weights: what a publisher checks before it publishes the version a
server already serves, when it did not publish that version itself (a new trainer process of the same run).

The comparison is of one digest of the weights as servers serve them (:func:`bridge.digest.served_digest_part`:
linear in the served bytes, so each trainer rank adds its own rows and the sum does not depend on the sharding):

- the reference server computes it of the tensors it serves, on request (``/wsync/weights_checksum`` with
  ``digest``), and says which run its version came from;
- real SGLang keeps nothing of the kind, so the publisher records it at commit, per server, beside the run:
  ``wsync/served_label/<url>`` = ``{"version", "digest", "run_id"}`` in the name resolution of ``writer_lock``
  when one is set (etcd or a shared directory), else in the default directory under this host's temp folder
  (:data:`bridge.name_resolve.DEFAULT_URL`). A label with no record of its own (set outside wsync, or by a
  trainer whose record lives elsewhere) cannot be compared, and is refused as such.

A version of another run (``experiment/trial``) is another sequence: the check applies to the served version's
own run, or to an unknown one. ``new_run=True`` skips it (a new run starts over).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import quote

import torch

from bridge.digest import served_digest_part
from bridge.errors import NameEntryNotFound
from bridge.log import get_logger

__all__ = ["LabelRecords", "label_key", "local_digest_part", "refusal"]

logger = get_logger(__name__)


def label_key(url: str) -> str:
    """The name-resolution key of the record of the version real SGLang at ``url`` serves."""
    return f"wsync/served_label/{quote(url, safe='')}"


class LabelRecords:
    """The records of what real SGLang servers serve (see the module docstring); rank 0 only."""

    def __init__(self, url: str | None):
        from bridge.name_resolve import DEFAULT_URL, make_name_resolve

        self.url = url or DEFAULT_URL
        self._nr = make_name_resolve(self.url)

    def read(self, server: str) -> dict | None:
        try:
            rec = json.loads(self._nr.get(label_key(server)))
        except NameEntryNotFound:
            return None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    def write(self, server: str, version: str, digest: str, run_id: str) -> None:
        self._nr.add(label_key(server), json.dumps({"version": version, "digest": digest, "run_id": run_id}),
                     replace=True)

    def forget(self, server: str) -> None:
        try:
            self._nr.delete(label_key(server))
        except NameEntryNotFound:
            pass

    def close(self) -> None:
        self._nr.close()


@torch.no_grad()
def local_digest_part(source, specs: Sequence) -> int | None:
    """This rank's share of the served-weights digest of ``specs`` (wire specs: the serving dtype), from its own
    rows (``local_shards``), with no communication; None when the source has no ``local_shards``."""
    if source.local_shards is None:
        return None
    total = 0
    for sh in source.local_shards(specs):
        if sh.local is not None:
            total += served_digest_part(sh.spec.name, sh.local.to(sh.spec.dtype), sh.start)
    return total % (1 << 64)


def refusal(url: str, version: int, why: str | None) -> str:
    """The one line a refused publish says (``why`` None: the weights differ)."""
    fix = "publish a new version, or pass new_run=True to start a new run"
    if why is None:
        return f"server {url} already serves version {version} with other weights (published by another process); {fix}"
    return f"server {url} already serves version {version}, and its weights cannot be compared with these ({why}); {fix}"
