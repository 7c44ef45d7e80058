"""Publishing a LoRA adapter alone: its tensors gathered from their FSDP shards, loaded by the servers under a
stable name, the version as the adapter's weight version.

An adapter is small (rank 16 on every projection of an 8B model: tens of MB against 16 GB of weights), so
it does not go through the full-weight encodings: :class:`AdapterPublisher` gathers it in one flat gather
(the source's ``gather_adapter``), and then, on rank 0:

- by disk (``via="disk"``): writes a PEFT adapter directory (``adapter_model.safetensors`` +
  ``adapter_config.json``) atomically, into a temporary directory renamed into place
  (``<root>/<name>/v<version>``), tells every server ``/load_lora_adapter`` with that path (real SGLang: with
  the stable link ``<root>/<name>/current``, switched to that directory first, see :func:`point_current`), then
  announces it in name resolution under :func:`adapter_key` (the commit: a version announced is served);
- by tensors, on one host (``via="tensors"``): ``/load_lora_adapter_from_tensors`` with the PEFT config
  and the tensors (the payload as the server's SGLang version takes it);
- by broadcast, reference servers only, any host (``via="broadcast"``): the project route
  ``/wsync/load_lora_adapter_from_distributed`` to every server at once and one broadcast of the gathered buffer on
  a weight-update group kept across publishes (:mod:`bridge.lora.broadcast`).

The servers replace the adapter under its name in one step (the reference server's ``wsync_replace``): a
client asking for the adapter by name never finds it missing. A publish is collective and every rank raises
the same error (:mod:`bridge.publisher.agreement`); a failure after some server took the new version loads the
previous version back into those servers, so every server keeps serving the previous adapter.

The source (the FSDP2 engine in ``trainer/`` with ``EngineConfig(lora=...)``) offers ``adapter_specs()``,
``adapter_config()`` and the collective ``gather_adapter(dtype)``.

Fault points (:mod:`bridge.failpoints`): ``adapter:prepare``, ``adapter:gather`` (after the gather),
``adapter:write`` (disk, before the write), ``adapter:rename`` (disk, after the files were written, before
the rename), ``adapter:servers`` (the servers found), ``adapter:load`` and ``adapter:load:<i>`` (before server ``i`` is told), ``adapter:announce``
(disk) and ``adapter:commit``. By broadcast every server is told at once: the ``adapter:load:<i>`` points all
come before that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bridge.digest import tensor_checksum
from bridge.errors import BridgeError, ConfigError, SyncError, VersionError
from bridge.failpoints import failpoint
from bridge.log import get_logger
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL
from bridge.publisher.agreement import STEP_ATTR, Agreement, in_step
from bridge.publisher.interrupts import held
from bridge.snapshot.writer import fsync_path
from bridge.tensors import dtype_from_str

__all__ = ["AdapterPublishResult", "AdapterPublisher", "AdapterPublisherConfig", "adapter_key", "sync_adapter_dir",
           "write_adapter_dir", "write_safetensors"]

logger = get_logger(__name__)

VIAS = ("disk", "tensors", "broadcast")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
SLACK_S = 5.0
"""Added to each step's bound: the exchange itself, on a loaded machine."""
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
CURRENT_LINK = "current"
"""``<root>/<name>/current``: a symlink to the version served, the path real SGLang servers load (:func:`point_current`)."""


def adapter_key(experiment: str, trial: str, name: str, version: int, root: str = "wsync") -> str:
    """``<root>/<experiment>/<trial>/lora_adapters/<name>/<version>``: the announcement of one adapter version
    (a JSON object: ``name``, ``version``, ``path``, ``checksums``)."""
    from bridge.name_resolve import names

    return f"{names.trial_root(experiment, trial, root)}/lora_adapters/{name}/{version}"


@dataclass(kw_only=True, slots=True)
class AdapterPublisherConfig:
    """Where and how an adapter goes. Checked when built."""

    name: str
    """The adapter's stable name on the servers (SGLang's ``lora_name``; what ``lora_path`` asks for)."""
    via: str = "disk"
    """``disk`` (a PEFT adapter directory, any host that sees ``root``), ``tensors`` (servers on this host) or
    ``broadcast`` (reference servers on any host, over a weight-update group)."""
    servers: Sequence[str] = ()
    """Base URLs of the servers that serve the adapter."""
    server_registry: str | Sequence[str] | None = None
    """Where more servers are found, read again at every publish, as ``PublisherConfig.server_registry``
    (``etcd://``, ``file:///dir``, ``router+http://``; servers registered for ``experiment``/``trial``)."""
    min_servers: int = 1
    """With servers or a registry: a publish fails (before anything is loaded) when fewer servers are found."""
    root: str | None = None
    """Disk: the folder of the adapter directories, ``<root>/<name>/v<version>`` (default: a folder under
    the temporary directory, per experiment and trial)."""
    keep: int = 3
    """Disk: adapter directories kept, the newest ones (at least 2: the previous one is the way back)."""
    name_resolve: str | None = None
    """Disk: where versions are announced (etcd://, file://, memory://; default: the project's default)."""
    experiment: str = DEFAULT_EXPERIMENT
    trial: str = DEFAULT_TRIAL
    dtype: str | None = None
    """The dtype the adapter travels and is served in (default: the trainer's, float32)."""
    http_timeout: float = 60.0
    """Seconds one server call may take."""
    gather_timeout: float = 120.0
    """Seconds the gather step may take on every rank."""
    api_key: str | None = None
    admin_api_key: str | None = None
    group_timeout: float = 60.0
    """Broadcast: seconds for the group's rendezvous and for each broadcast."""
    master_address: str | None = None
    """Broadcast: this host's address as the servers reach it (default: 127.0.0.1 with local servers only, else the
    address of the interface that routes to them)."""
    master_port: int | None = None
    """Broadcast: the group's rendezvous port (default: a free one)."""
    backend: str | None = None
    """Broadcast: ``gloo`` or ``nccl`` (default: :func:`bridge.process_group.default_backend`; the reference server
    on CPU takes gloo)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"adapter name must be letters, digits, '.', '_' or '-' (a path component), got {self.name!r}")
        if self.via not in VIAS:
            raise ConfigError(f"via must be one of {', '.join(VIAS)} (an adapter goes by disk, on one host by tensors, "
                              f"or to reference servers by broadcast), got {self.via!r}")
        if isinstance(self.servers, str):
            raise ConfigError(f"servers must be a list of URLs, got the string {self.servers!r}")
        self.servers = [str(s).rstrip("/") for s in self.servers]
        if isinstance(self.server_registry, str):
            self.server_registry = [self.server_registry]
        self.server_registry = list(self.server_registry or ()) or None
        from bridge.fleet.discovery import check_registry_url

        for url in self.server_registry or ():
            check_registry_url(url)
        if isinstance(self.min_servers, bool) or not isinstance(self.min_servers, int) or self.min_servers < 1:
            raise ConfigError(f"min_servers must be an integer >= 1, got {self.min_servers!r}")
        if self.via in ("tensors", "broadcast") and not self.servers and not self.server_registry:
            raise ConfigError(f"via={self.via!r} sends the adapter to servers: give servers=[URL, ...] or "
                              "server_registry=URL")
        self._check_broadcast()
        if self.keep < 2:
            raise ConfigError(f"keep must be >= 2 (the previous adapter is what a failed publish goes back to), got {self.keep}")
        if self.dtype is not None:
            dtype_from_str(self.dtype)  # raises ConfigError naming the dtype
        for what in ("http_timeout", "gather_timeout", "group_timeout"):
            if not getattr(self, what) > 0:
                raise ConfigError(f"{what} must be a positive number of seconds, got {getattr(self, what)}")
        if self.root is None:
            import tempfile

            self.root = os.path.join(tempfile.gettempdir(), f"wsync_{os.getuid()}", "adapters", self.experiment, self.trial)

    def _check_broadcast(self) -> None:
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend must be gloo or nccl (or None: nccl with CUDA, gloo without), got {self.backend!r}")
        if self.master_port is not None and (isinstance(self.master_port, bool) or not isinstance(self.master_port, int)
                                             or not 0 < self.master_port < 65536):
            raise ConfigError(f"master_port must be a port number (1-65535), got {self.master_port!r}")
        if self.master_address is not None and not str(self.master_address).strip():
            raise ConfigError("master_address must not be empty (leave it out: 127.0.0.1 for servers on this host, "
                              "else this host's address on the way to them)")


@dataclass(frozen=True, slots=True)
class AdapterPublishResult:
    """What one adapter publish did (the same on every rank)."""

    name: str
    version: int
    via: str
    bytes: int
    seconds: float
    path: str | None
    """Disk: the adapter directory the servers loaded."""
    checksums: dict[str, str]
    """sha256 of every tensor as sent (:func:`bridge.digest.tensor_checksum`)."""
    phases: dict[str, float]
    """Seconds of each step on this rank (rank 0's: the gather, the write, the servers' loads...)."""


@dataclass(slots=True)
class _Published:
    """Rank 0's record of a version the servers serve: what a failed publish loads back."""

    version: int
    path: str | None
    config: dict
    tensors: dict[str, torch.Tensor] | None
    pending_checksums: _Checksums | None
    """sha256 of every tensor, computed once on rank 0 in the background (the servers check them when the adapter
    goes by tensors; the result reports them)."""
    buffer: torch.Tensor | None = None
    """The gathered buffer ``tensors`` are views of (its storage, 1-D uint8)."""
    copied: bool = True
    """Every server that loaded ``tensors`` copied them before it answered (reference servers; real SGLang keeps the
    same-host tensors it is handed as the adapter's CPU weights): its buffer may be gathered into again."""

    @property
    def checksums(self) -> dict[str, str] | None:
        return self.pending_checksums.result() if self.pending_checksums is not None else None


class AdapterPublisher:
    """Publishes versions of one LoRA adapter (see the module docstring). Collective: every rank builds it
    and calls :meth:`publish` with the same version."""

    def __init__(self, config: AdapterPublisherConfig | None = None, **kwargs):
        if config is None:
            config = AdapterPublisherConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an AdapterPublisherConfig or keyword arguments, not both")
        self.config = config
        self._agree = Agreement.of_default_group()
        self._rank = self._agree.rank
        self._last: int | None = None
        self._served: _Published | None = None  # rank 0
        self._clients: dict = {}  # rank 0: URL -> client, for every server found so far
        self._warned: set[str] = set()  # real SGLang servers told that a tensors replace refuses generations
        self._current: list[str] = []  # rank 0: the servers of this publish, found at its start
        self._sources = None  # rank 0: where the servers are found (bridge.fleet.discovery), opened once
        self._nr = None  # rank 0, disk
        self._took: list = []  # rank 0: the servers that loaded the version being published
        self._announced: str | None = None  # rank 0: its announcement key, once made
        self._phases: dict[str, float] = {}
        self._removing = None  # rank 0, disk: the removal of old directories, left running by the last commit
        self._syncing = None  # rank 0, disk: the fsyncs of the directory being published (:meth:`_write`)
        self._spare: _Published | None = None  # rank 0: a gather's buffer no one uses any more, the next one's memory
        self._group = None  # rank 0, broadcast: the servers' weight-update group (bridge.lora.broadcast)

    @property
    def last_version(self) -> int | None:
        return self._last

    def publish(self, source, version: int) -> AdapterPublishResult:
        """Publish ``source``'s adapter as ``version`` (collective: every trainer rank calls it).

        Raises (the same error on every rank):
            VersionError: ``version`` is not above the last one published.
            ConfigError: the source has no adapter, or a setting is wrong.
            SyncError / SyncTimeout / SnapshotError / NameResolveError: the publish failed; every server
                serves the previous adapter version.
        """
        with held(self._rank):  # Ctrl-C / SIGTERM: the step ends and every rank cleans up, then it takes effect
            return self._publish(source, version)

    def _publish(self, source, version: int) -> AdapterPublishResult:
        t0 = time.perf_counter()
        cfg = self.config
        self._phases = {}
        self._removed()
        specs = self._step("adapter:prepare", lambda: self._part("adapter:prepare", lambda: self._prepare(source, version)),
                           SLACK_S)[0]
        dtype = dtype_from_str(cfg.dtype) if cfg.dtype is not None else None
        new = _Published(version, None, {}, None, None)  # rank 0: filled by the gather, then the write
        self._took, self._announced = [], None
        undo = lambda: self._undo(new)  # noqa: E731

        def gather() -> int:
            """The collective gather (every rank joins it, then agrees on it before rank 0 loads anything); then,
            on rank 0, the servers of this publish: their number bounds the next step on every rank."""
            reuse = self._take_spare()
            got = self._part("adapter:gather", lambda: _gathered(source, dtype, cfg.via == "tensors", reuse),
                             point_after=True) or {}
            new.config, new.pending_checksums = got.get("config", {}), got.get("checksums")
            new.tensors, new.buffer = got.get("tensors"), got.get("buffer")
            return self._part("adapter:servers", self._find_servers)

        found = self._step("adapter:gather", gather, cfg.gather_timeout + cfg.http_timeout, undo)[0]

        def deliver():
            """Rank 0: write the directory (disk), load it into every server, announce it (disk); every rank: the
            commit's fault point. One agreed step: a failure of any part on any rank undoes what was done."""
            if cfg.via == "disk":
                new.path = self._part("adapter:write", lambda: self._write(version, new.tensors, new.config))
                new.tensors = None  # the servers load the directory; the tensors are not kept, their buffer is spare
                self._spare = _Published(version, None, {}, None, new.pending_checksums, new.buffer)
            self._part("adapter:load", lambda: self._load_all(new))
            if cfg.via == "disk":
                self._part("adapter:announce", lambda: self._announce(new))
            return self._part("adapter:commit", lambda: new.checksums)

        bound = cfg.http_timeout * (1 + found + (2 if cfg.via == "disk" else 0))  # + the write and the announcement
        if cfg.via == "broadcast":  # + the group's rendezvous and the broadcast
            bound += 2 * cfg.group_timeout
        checksums = self._step("adapter:load", deliver, bound, undo)[0]
        self._committed(new)
        return AdapterPublishResult(cfg.name, version, cfg.via, sum(s[1] for s in specs), time.perf_counter() - t0,
                                    new.path, checksums, dict(self._phases))

    def close(self) -> None:
        """Close the server connections and name resolution (the servers keep serving the adapter). Collective
        when the publisher published: rank 0 waits (a few seconds at most) until every rank is done with it."""
        if self._last is not None:
            self._agree.finish(SLACK_S)
            self._last = None
        self._removed()
        if self._group is not None:
            self._group.teardown()
            self._group = None
        for c in self._clients.values():
            c.close()
        for source in self._sources or ():
            source.close()
        if self._nr is not None:
            self._nr.close()
        self._clients, self._sources, self._nr = {}, None, None

    def __enter__(self) -> AdapterPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps

    def _step(self, name: str, fn, bound: float, undo=None) -> list:
        """``fn`` on every rank (it checks ``rank == 0`` itself), agreed: every rank's result, or on a failure of
        any rank ``undo()`` on every rank and then the same error, naming the part that failed (:meth:`_part`)."""
        t0 = time.perf_counter()
        try:
            return self._agree.step(name, fn, timeout=bound + SLACK_S)
        except BridgeError as e:
            if undo is not None:
                undo()
            error = type(e)(f"adapter {self.config.name!r}: publish failed at {getattr(e, STEP_ATTR, None) or name}: {e}")
            if e.interrupt is not None:  # raised in the step on this rank: it ends the program, after the undo
                raise e.interrupt from error
            raise error from None
        finally:
            self._phases.setdefault(name.removeprefix("adapter:"), time.perf_counter() - t0)  # unless a part has it

    def _part(self, name: str, fn, point_after: bool = False):
        """One part of a step: its fault point ``name`` first (after ``fn`` when ``fn`` is a collective, which every
        rank must join), its seconds in the publish's phases, an error in it marked as raised in ``name``."""
        t0 = time.perf_counter()
        try:
            if not point_after:
                failpoint(name, self._rank)
            out = fn()
            if point_after:
                failpoint(name, self._rank)
            return out
        except BaseException as e:
            in_step(e, name)
            raise
        finally:
            self._phases[name.removeprefix("adapter:")] = time.perf_counter() - t0

    def _prepare(self, source, version: int) -> list[tuple[str, int]]:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"version must be an int >= 0, got {version!r}")
        if self._last is not None and version <= self._last:
            raise VersionError(f"adapter {self.config.name!r}: version {version} is not above the last one published "
                               f"({self._last}); publish a higher version")
        if not callable(getattr(source, "gather_adapter", None)):
            raise ConfigError(f"{type(source).__name__} has no LoRA adapter to publish (no gather_adapter); train one "
                              "with EngineConfig(lora=LoraConfig(...))")
        if self._rank == 0 and self._served is None and self.config.via == "disk":
            self._served = self._newest_announced()
            if self._served is not None and version <= self._served.version:
                raise VersionError(f"adapter {self.config.name!r}: version {version} is not above version "
                                   f"{self._served.version} announced for {self.config.experiment}/{self.config.trial}; "
                                   "publish a higher version (or use a new trial)")
        dtype = dtype_from_str(self.config.dtype) if self.config.dtype is not None else None
        return [(s.name, s.nbytes if dtype is None else s.nbytes // s.dtype.itemsize * dtype.itemsize)
                for s in source.adapter_specs()]

    def _names(self):
        """Rank 0: name resolution, opened once."""
        if self._nr is None:
            from bridge.name_resolve import DEFAULT_URL, make_name_resolve

            self._nr = make_name_resolve(self.config.name_resolve or DEFAULT_URL)
        return self._nr

    def newest_announced_version(self) -> int | None:
        """Disk: the newest version of this adapter announced for the experiment and trial (by any run), or None."""
        newest = self._newest_announced()
        return newest.version if newest is not None else None

    def _newest_announced(self) -> _Published | None:
        """Before this publisher's first publish: the newest version of the adapter announced (by an earlier run)
        whose directory is still there, which the servers serve and a failed publish loads back; None if none."""
        from bridge.name_resolve import names

        cfg = self.config
        prefix = adapter_key(cfg.experiment, cfg.trial, cfg.name, 0).rsplit("/", 1)[0]
        found = sorted((v, k) for k in self._names().find_subtree(prefix) if (v := names.version_of(k)) is not None)
        for version, key in reversed(found):
            path = json.loads(self._names().get(key)).get("path")
            if path and os.path.isfile(os.path.join(path, ADAPTER_FILE)):
                return _Published(version, path, {}, None, None)
        return None

    def _write(self, version: int, tensors, adapter_config) -> str | None:
        """Rank 0: the directory, in place but not yet durable: its fsyncs run while the servers load it (they read
        what was written), and end before it is announced (:meth:`_durable`), the commit."""
        if self._rank != 0:
            return None
        folder = os.path.join(self.config.root, self.config.name)
        path = write_adapter_dir(folder, version, tensors, adapter_config, durable=False)
        self._syncing = _BACKGROUND.submit(sync_adapter_dir, path)
        return path

    def _durable(self) -> None:
        """Rank 0: wait for the fsyncs of the directory written (:meth:`_write`); their error is the write's."""
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            try:
                syncing.result()
            except BaseException as e:
                in_step(e, "adapter:write")
                raise

    def _find_servers(self) -> int:
        """Rank 0: the servers of this publish, found again (the fixed list, then each registry); their number.
        Fewer than ``min_servers`` (when any server is configured) fails the publish before anything is loaded."""
        if self._rank != 0:
            return 0
        from bridge.fleet.discovery import open_sources

        cfg = self.config
        if self._sources is None:
            self._sources = open_sources(cfg.servers, cfg.server_registry or (), cfg.experiment, cfg.trial,
                                         timeout=cfg.http_timeout)
        urls: list[str] = []
        for source in self._sources:
            urls += [u.rstrip("/") for u in source.urls() if u.rstrip("/") not in urls]
        if (cfg.servers or cfg.server_registry) and len(urls) < cfg.min_servers:
            where = ", ".join(s.url for s in self._sources)
            raise SyncError(f"found {len(urls)} server(s) ({', '.join(urls) or 'none'}) in {where}, fewer than "
                            f"min_servers={cfg.min_servers}; register more servers (wsync serve --register) or lower "
                            "min_servers")
        self._current = urls
        if cfg.via == "broadcast":  # before anything moves
            from bridge.lora.broadcast import require_reference_servers

            require_reference_servers(self._servers())
        return len(urls)

    def _servers(self):
        """Rank 0: a client of each server of this publish (found by :meth:`_find_servers`)."""
        from bridge.client import ServerClient

        cfg = self.config
        for u in self._current:
            if u not in self._clients:
                self._clients[u] = ServerClient(u, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key,
                                                timeout=cfg.http_timeout)
        return [self._clients[u] for u in self._current]

    def _load_all(self, new: _Published) -> None:
        """Rank 0: every server loads ``new`` (the ones that did are recorded, for :meth:`_undo`)."""
        if self._rank != 0:
            return
        if self.config.via == "broadcast":
            self._broadcast_all(new)
            return
        for i, client in enumerate(self._servers()):
            failpoint(f"adapter:load:{i}", 0)
            self._took.append(client)  # before the call: a server that timed out may have loaded it
            new.copied = new.copied and client.is_reference_server
            self._load(client, new)

    def _load(self, client, p: _Published) -> None:
        """One server loads ``p`` under the stable name, replacing what it serves there in one step
        (:class:`bridge.client.lora.LoraRoutes`)."""
        name = self.config.name
        if p.path is not None:
            # Real SGLang replaces by unload-then-load and reloads an unloaded name from its last path for a
            # generation asking for it in between: a stable path already showing this version makes that
            # generation get it (bridge.client.lora), never a refusal nor the old version.
            if not client.is_reference_server:
                self._durable()  # `current` only ever points at a durable directory
            path = p.path if client.is_reference_server else point_current(p.path)
            client.load_adapter_from_path(name, path, version=str(p.version), replace=True)
        else:
            if not client.is_reference_server and client.url not in self._warned:
                self._warned.add(client.url)
                logger.warning("adapter %r by tensors into real SGLang %s: a generation asking for it while it is "
                               "replaced is refused (SGLang cannot reload a tensors adapter); via='disk' refuses none",
                               name, client.url)
            client.load_adapter_from_tensors(name, p.config, p.tensors, version=str(p.version), replace=True,
                                             checksums=p.checksums)

    def _broadcast_all(self, new: _Published) -> None:
        """Rank 0, broadcast: every server loads ``new`` at once over the group (made on the first publish)."""
        from bridge.lora.broadcast import AdapterGroup, GroupLost

        clients = self._servers()
        for i in range(len(clients)):
            failpoint(f"adapter:load:{i}", 0)
        if self._group is None:
            self._group = AdapterGroup(self.config)
        self._group.ensure(clients)
        self._took.extend(clients)  # before the call: a server that timed out may have loaded it
        try:
            self._group.load(new.version, new.config, new.tensors, new.buffer, new.checksums)
        except GroupLost as e:  # a server lost the kept group (restarted at its URL): once more on a new one
            logger.info("adapter %r: %s; loading it again over a new group", self.config.name, e)
            self._group.ensure(clients)
            self._group.load(new.version, new.config, new.tensors, new.buffer, new.checksums)

    def _broadcast_back(self, clients, prev: _Published) -> list[str]:
        """Rank 0, broadcast: ``clients`` load ``prev`` again, over a group of theirs (the failed publish's group
        was torn down); what failed, one clause each."""
        try:
            self._group.ensure(clients)
            self._group.load(prev.version, prev.config, prev.tensors, prev.buffer, prev.checksums)
        except BaseException as e:  # report it; the error raised is the publish's own
            return [f"{', '.join(c.url for c in clients)}: {e}"]
        return []

    def _load_back(self, clients) -> str:
        """Load the previous version into ``clients``; a clause for the error saying what they serve now."""
        if not clients:
            return ""
        prev = self._served
        if prev is not None and self.config.via == "broadcast":
            failed = self._broadcast_back(clients, prev)
            what = f"version {prev.version}"
            if failed:
                return f"; could not put {what} back on {'; '.join(failed)}"
            return f"; {len(clients)} server(s) that had loaded it serve {what} again"
        failed = []
        for client in clients:
            try:
                if prev is None:
                    client.unload_adapter(self.config.name)
                else:
                    self._load(client, prev)
            except BaseException as e:  # report it; the error raised is the publish's own
                failed.append(f"{client.url}: {e}")
        what = f"version {prev.version}" if prev is not None else "no adapter"
        if failed:
            return f"; could not put {what} back on {'; '.join(failed)}"
        return f"; {len(clients)} server(s) that had loaded it serve {what} again"

    def _undo(self, new: _Published) -> None:
        """After a failed step of any rank: on rank 0, the servers that loaded ``new`` load the previous version
        back, its announcement and its directory are removed. Never raises (what failed is logged)."""
        if self._rank != 0:
            return
        try:
            self._durable()  # (the directory is removed below: its fsyncs end first)
        except BaseException:  # the publish fails anyway
            pass
        if self._group is not None:  # not trusted after a failure: a new one for the servers that go back
            self._group.teardown()
        status = self._load_back(self._took)
        self._took = []
        if self._announced is not None:
            try:
                self._nr.delete(self._announced)
            except Exception as e:  # reported; the publish's own error is raised
                status += f"; could not remove the announcement {self._announced}: {e}"
            self._announced = None
        if new.path is not None and (self._served is None or self._served.path != new.path):
            link = os.path.join(os.path.dirname(new.path), CURRENT_LINK)
            if os.path.islink(link) and os.readlink(link) == os.path.basename(new.path):
                os.unlink(link)  # a first version that failed: nothing to show
            shutil.rmtree(new.path, ignore_errors=True)
        if status:
            logger.warning("adapter %r version %d not published%s", self.config.name, new.version, status)

    def _announce(self, new: _Published) -> None:
        if self._rank != 0:
            return
        self._durable()  # a version announced is on disk
        cfg = self.config
        value = {"name": cfg.name, "version": new.version, "path": new.path}
        key = adapter_key(cfg.experiment, cfg.trial, cfg.name, new.version)
        self._names().add(key, json.dumps(value), replace=True)
        self._announced = key

    def _committed(self, new: _Published) -> None:
        """Every rank agreed: ``new`` is the version served (what a later failure goes back to)."""
        self._last = new.version
        if self._rank != 0:
            return
        old, self._served, self._took, self._announced = self._served, new, [], None
        if old is not None and old.tensors is not None and old.copied:  # by tensors: no server holds its buffer
            self._spare = old
        if new.path is not None:  # in the background (a few ms of unlinks): done before the next publish or close()
            self._removing = _BACKGROUND.submit(_remove_old, os.path.dirname(new.path), self.config.keep)

    def _take_spare(self) -> torch.Tensor | None:
        """Rank 0: the spare buffer to gather into (its checksums, which read it, finished first), or None."""
        spare, self._spare = self._spare, None
        if spare is None or spare.buffer is None:
            return None
        if spare.pending_checksums is not None:
            try:
                spare.pending_checksums.result()
            except Exception:  # a failed publish's: nothing reads them
                pass
        return spare.buffer

    def _removed(self) -> None:
        """Rank 0: wait for the old directories' removal started by the last commit (never raises)."""
        removing, self._removing = self._removing, None
        if removing is not None and (e := removing.exception()) is not None:
            logger.warning("adapter %r: could not remove old versions' directories: %s", self.config.name, e)


_BACKGROUND = ThreadPoolExecutor(1, thread_name_prefix="wsync-adapter-disk")
"""Rank 0's disk work beside a publish: a directory's fsyncs (:meth:`AdapterPublisher._write`), the removal of old
ones after a commit (one thread: a publish waits for the removal before it writes)."""
_CHECKSUM_THREADS = 2
_CHECKSUMS = ThreadPoolExecutor(_CHECKSUM_THREADS, thread_name_prefix="wsync-adapter-checksums")


class _Checksums:
    """sha256 of every tensor, computed on :data:`_CHECKSUM_THREADS` threads in the background (hashlib leaves the
    GIL), about the same bytes on each; :meth:`result` waits for them (a Future's interface)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        parts: list[list[str]] = [[]]
        cut, acc = sum(t.nbytes for t in tensors.values()) / _CHECKSUM_THREADS, 0
        for n, t in tensors.items():
            if acc >= cut * len(parts) and len(parts) < _CHECKSUM_THREADS:
                parts.append([])
            parts[-1].append(n)
            acc += t.nbytes
        self._futures = [_CHECKSUMS.submit(lambda part=part: {n: tensor_checksum(tensors[n]) for n in part})
                         for part in parts]

    def result(self) -> dict[str, str]:
        return {n: c for f in self._futures for n, c in f.result().items()}


def _gathered(source, dtype, shared: bool, reuse: torch.Tensor | None = None) -> dict | None:
    """The collective gather: ``{"tensors": on the CPU, "config": the PEFT config, "checksums", "buffer": the buffer
    the tensors are views of}`` on rank 0, None elsewhere. ``shared`` (by tensors): gathered into shared memory, which
    the servers map (``gather_adapter(shared=True)``); ``reuse``: a spare buffer of an earlier gather to fill again."""
    kwargs = {"shared": True} if shared else {}
    if reuse is not None:
        kwargs["reuse"] = reuse
    tensors = source.gather_adapter(dtype, **kwargs)
    if tensors is None:
        return None
    # Views of the gathered buffer, which they keep alive: copied only when the gather ran on a GPU.
    if any(t.device.type != "cpu" for t in tensors.values()):
        tensors = {n: t.detach().to("cpu") for n, t in tensors.items()}
    buffer = None
    if tensors:
        storage = next(iter(tensors.values())).untyped_storage()
        if all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors.values()):
            buffer = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    # sha256 of medium's 9.7 MB takes ~7 ms: computed on two threads beside the exchange, the write and the body.
    return {"tensors": tensors, "config": source.adapter_config(), "checksums": _Checksums(tensors), "buffer": buffer}


def write_adapter_dir(folder: str, version: int, tensors: dict[str, torch.Tensor], adapter_config: dict, *,
                      durable: bool = True) -> str:
    """Write a PEFT adapter directory ``<folder>/v<version>`` atomically (temporary directory, fsync, rename);
    its path. A directory of that version already there (a failed publish's) is replaced.

    The safetensors file is written from the tensors' own bytes (:func:`write_safetensors`: one write for an adapter
    gathered flat); the two files and the temporary directory are fsynced at once, the journal's commits shared.
    ``durable=False``: nothing is fsynced (the directory still appears whole, by the rename): call
    :func:`sync_adapter_dir` before announcing it (:class:`AdapterPublisher` runs it while the servers load it).

    Raises:
        SnapshotError: the write failed (the disk is full, the folder is not writable).
    """
    from bridge.errors import SnapshotError

    final = os.path.join(folder, f"v{version}")
    tmp = os.path.join(folder, f".tmp-v{version}-{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(tmp)
        write_safetensors(os.path.join(tmp, ADAPTER_FILE), tensors, {"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(adapter_config, f, indent=2, sort_keys=True)
        if durable:
            _fsync_all([(os.path.join(tmp, ADAPTER_FILE), False), (os.path.join(tmp, CONFIG_FILE), False), (tmp, True)])
        failpoint("adapter:rename", 0)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        if durable:
            fsync_path(folder, directory=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise SnapshotError(f"could not write adapter version {version} into {folder}: {e}; free space or choose "
                                "another root") from None
        raise
    return final


def sync_adapter_dir(path: str) -> None:
    """Make an adapter directory written with ``durable=False`` durable: its two files, itself and its folder (the
    rename) fsynced at once.

    Raises:
        SnapshotError: an fsync failed.
    """
    from bridge.errors import SnapshotError

    try:
        _fsync_all([(os.path.join(path, ADAPTER_FILE), False), (os.path.join(path, CONFIG_FILE), False), (path, True),
                    (os.path.dirname(path), True)])
    except OSError as e:
        raise SnapshotError(f"could not write adapter directory {path} durably: {e}; free space or choose another "
                            "root") from None


_FSYNCS = ThreadPoolExecutor(3, thread_name_prefix="wsync-adapter-fsync")


def _fsync_all(paths: list[tuple[str, bool]]) -> None:
    """fsync every ``(path, is_directory)`` at once (all but the first on :data:`_FSYNCS`, the first here): the
    filesystem commits them together instead of one after the other. Raises the first OSError."""
    futures = [_FSYNCS.submit(fsync_path, p, directory=d) for p, d in paths[1:]]
    try:
        fsync_path(paths[0][0], directory=paths[0][1])
    finally:
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of ``tensors`` (in their order), written from their own bytes: the header, then each
    tensor's bytes, tensors that lie side by side in one storage in one write (an adapter gathered flat: the whole
    data in one write, no copy). safetensors' ``save_file`` writes anything else (a tensor not on the CPU, a dtype
    outside the format's common ones). Read back by safetensors (and so PEFT and SGLang) as ``save_file``'s."""
    from safetensors.torch import save_file

    items = [(str(n), t.detach()) for n, t in tensors.items()]
    if not items or any(t.device.type != "cpu" or t.dtype not in _ST_DTYPES for _, t in items):
        save_file({n: t.contiguous() for n, t in items}, path, metadata=metadata)
        return
    items = [(n, t.contiguous()) for n, t in items]
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    spans: list[list] = []  # [storage, first byte, end byte]: the data, adjacent tensors merged
    offset = 0
    for n, t in items:
        size = t.numel() * t.element_size()
        header[n] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
        if size == 0:
            continue
        storage, start = t.untyped_storage(), t.storage_offset() * t.element_size()
        if spans and spans[-1][0].data_ptr() == storage.data_ptr() and spans[-1][2] == start:
            spans[-1][2] = start + size
        else:
            spans.append([storage, start, start + size])
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data 8-byte aligned, as safetensors writes it
    with open(path, "wb", buffering=0) as f:
        _write_all(f, len(head).to_bytes(8, "little") + head)
        for storage, start, end in spans:
            _write_all(f, torch.empty(0, dtype=torch.uint8).set_(storage, start, (end - start,)).numpy())


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def point_current(path: str) -> str:
    """Point ``<folder>/current`` at the adapter directory ``path`` (``<folder>/v<version>``): a relative symlink
    renamed over the old one (atomic); the link's path, the stable path real SGLang servers load the adapter by."""
    folder = os.path.dirname(path)
    link = os.path.join(folder, CURRENT_LINK)
    tmp = os.path.join(folder, f".tmp-{CURRENT_LINK}-{uuid.uuid4().hex[:12]}")
    os.symlink(os.path.basename(path), tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_path(folder, directory=True)
    return link


def _remove_old(folder: str, keep: int) -> None:
    """Keep the ``keep`` newest ``v<version>`` directories of ``folder``."""
    versions = sorted(int(d[1:]) for d in os.listdir(folder) if d.startswith("v") and d[1:].isdigit())
    for v in versions[:-keep]:
        shutil.rmtree(os.path.join(folder, f"v{v}"), ignore_errors=True)
