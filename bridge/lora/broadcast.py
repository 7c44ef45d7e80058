"""An adapter by broadcast (:class:`bridge.AdapterPublisher` ``via="broadcast"``), trainer rank 0's side: the
weight-update group of the publish's servers and one broadcast of the gathered adapter per load.

Reference servers only: SGLang has no distributed adapter route, so real SGLang gets an adapter by disk or, on its
host, by tensors. The group is made on the first load (``/init_weights_update_group`` to every server at once, this
process joining as rank 0: :func:`bridge.transports.broadcast.make_group`, the weight broadcast's own), named
``wsync_lora_<name>-<8 hex>``, and kept across publishes; it is torn down (both sides, best effort) after a failed
load, when the set of servers changes, when a server no longer lists it (``/server_info``, asked before each load:
restarted at its URL), and on close. A load posts ``/wsync/load_lora_adapter_from_distributed`` to
every server at once and broadcasts the flat buffer the adapter was gathered into (``dist.broadcast`` of uint8), then
waits for the answers and the broadcast against one deadline (``group_timeout + http_timeout``), as the weight
broadcast's ``settle`` does.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bridge.buckets import Bucket, flatten_tensors
from bridge.errors import BridgeError, ConfigError, ServerError, SyncError, SyncTimeout, VersionError
from bridge.log import get_logger
from bridge.process_group import default_backend
from bridge.tensors import ParamSpec

__all__ = ["AdapterGroup", "GroupLost", "flat_layout", "require_reference_servers"]

logger = get_logger(__name__)

_NO_GROUP = "Please call init_weights_update_group first"
"""SGLang's words (and the reference server's) for a request on a group the server does not have."""


class GroupLost(SyncError):
    """A server no longer has the group (it restarted at the same URL, or dropped the group): a new group, made for
    the same servers, can carry the load again."""


def require_reference_servers(clients) -> None:
    """ConfigError naming the servers that are not the reference server (checked before anything moves)."""
    real = [c.url for c in clients if not c.can.lora_over_group]
    if real:
        raise ConfigError(f"via='broadcast' loads the adapter over a weight-update group, which only the reference "
                          f"server (wsync serve) takes; {', '.join(real)} is real SGLang, which has no such route: use "
                          "via='disk' (any host) or via='tensors' (servers on this host)")


def flat_layout(tensors: dict[str, torch.Tensor], buffer: torch.Tensor | None) -> tuple[Bucket, torch.Tensor]:
    """The adapter as one flat uint8 buffer in :class:`~bridge.buckets.Bucket`'s layout and that layout: ``buffer``
    itself when the tensors are views of it at the layout's offsets in their order (what ``gather_adapter``
    returns), else the tensors packed into a new buffer (largest itemsize first: every offset aligned)."""
    specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    try:
        bucket = Bucket(specs)
    except ConfigError:  # an offset its dtype cannot start at: packed below
        bucket = None
    if bucket is not None and buffer is not None and buffer.numel() == bucket.nbytes:
        ptr = buffer.untyped_storage().data_ptr() + buffer.storage_offset()
        if all(t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size() == ptr + o and t.is_contiguous()
               for t, o in zip(tensors.values(), bucket.offsets)):
            return bucket, buffer
    bucket = Bucket(sorted(specs, key=lambda s: -s.dtype.itemsize))
    return bucket, flatten_tensors(bucket, tensors)


class AdapterGroup:
    """Rank 0: the weight-update group of one adapter publisher's servers (see the module docstring)."""

    def __init__(self, config):
        self.config = config  # an AdapterPublisherConfig
        self.backend = config.backend or default_backend()
        self.servers = None  # bridge.client.ServerGroup of the group's servers
        self.pg: dist.ProcessGroup | None = None
        self.name: str | None = None

    def ensure(self, clients: list) -> None:
        """A group of exactly ``clients``: the one kept, or a new one (the old one torn down first, on the servers
        that stay)."""
        from bridge.client import ServerGroup
        from bridge.transports.broadcast import make_group

        urls = [c.url for c in clients]
        if self.pg is not None and self.servers.urls == urls:
            lost = self._lost()
            if not lost:
                return
            logger.info("adapter group %s: %s no longer have it (restarted?); making a new one", self.name, lost)
        self.teardown(keep=set(urls))
        cfg = self.config
        servers = ServerGroup(clients)
        try:
            self.pg, self.name = make_group(
                servers, prefix=f"wsync_lora_{cfg.name}", master_address=cfg.master_address,
                master_port=cfg.master_port, backend=self.backend, group_timeout=cfg.group_timeout,
                http_timeout=cfg.http_timeout)
        except BaseException:
            servers.close(clients=False)
            raise
        self.servers = servers

    def _lost(self) -> list[str]:
        """The servers that no longer list the group (``/server_info``: a server restarted at its URL has lost it),
        asked all at once; one that does not answer counts as lost (a new group then finds out)."""
        futures = self.servers.submit(lambda c: c.server_info(timeout=self.config.http_timeout))
        lost = []
        for c, f in zip(self.servers.clients, futures):
            try:
                states = f.result().get("internal_states") or [{}]
            except Exception:  # unreachable or a foreign answer: a new group finds out what is wrong
                lost.append(c.url)
                continue
            groups = states[0].get("weight_update_groups") if isinstance(states[0], dict) else None
            if groups is not None and self.name not in groups:
                lost.append(c.url)
        return lost

    def load(self, version: int, config: dict, tensors: dict[str, torch.Tensor], buffer: torch.Tensor | None,
             checksums: dict[str, str] | None) -> None:
        """Every server of the group loads the adapter: the request to all at once, one broadcast of its buffer,
        the answers and the broadcast against one deadline. Any failure tears the group down, then raises
        (SyncError naming each server's refusal; VersionError when every refusal is the version's)."""
        cfg = self.config
        bucket, buf = flat_layout(tensors, buffer)
        if self.backend == "nccl":
            buf = buf.to(torch.device("cuda", torch.cuda.current_device()))
        seconds = cfg.group_timeout + cfg.http_timeout
        try:
            futures = self.servers.submit(lambda c: c.load_adapter_from_distributed(
                cfg.name, config, names=[s.name for s in bucket.specs], dtypes=[s.dtype for s in bucket.specs],
                shapes=[list(s.shape) for s in bucket.specs], group_name=self.name, version=str(version),
                replace=True, checksums=checksums, timeout=seconds))
            work = dist.broadcast(buf, src=0, group=self.pg, async_op=True)
            deadline = time.monotonic() + seconds
            _answers(self.servers.clients, futures, deadline, seconds)
            try:
                work.wait(timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except RuntimeError as e:
                raise SyncError(f"the adapter's broadcast on group {self.name} failed: {e}") from e
        except BaseException:
            self.teardown()
            raise

    def teardown(self, keep: set[str] | None = None) -> None:
        """Destroy the group here and on its servers (those in ``keep`` only, when given); best effort, never raises."""
        from bridge.transports.broadcast import teardown_group

        pg, name, servers, self.pg, self.name, self.servers = self.pg, self.name, self.servers, None, None, None
        if servers is None:
            return
        try:
            teardown_group(pg, name, [c for c in servers.clients if keep is None or c.url in keep])
        except Exception as e:  # the publish's own error (or close) goes on
            logger.warning("adapter group %s: could not tear it down: %s", name, e)
        finally:
            servers.close(clients=False)


def _answers(clients: list, futures: list, deadline: float, seconds: float) -> None:
    """Wait for every server's answer until ``deadline``; raise what the servers refused, one clause each."""
    errors: list = []
    for c, f in zip(clients, futures):
        try:
            f.result(timeout=max(0.1, deadline - time.monotonic()))
        except cf.TimeoutError:
            errors.append(SyncTimeout(f"{c.url}: no answer to the adapter load within {seconds:g} s "
                                      "(group_timeout + http_timeout)"))
        except BridgeError as e:
            errors.append(e)
        except Exception as e:  # a foreign error names its server
            errors.append(ServerError(c.url, f"{type(e).__name__}: {e}"))
    if errors:
        kind = VersionError if all(isinstance(e, VersionError) for e in errors) else SyncError
        if kind is SyncError and any(isinstance(e, ServerError) and _NO_GROUP in str(e) for e in errors):
            kind = GroupLost
        raise kind("; ".join(map(str, errors)))
