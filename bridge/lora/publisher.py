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

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass

import torch

from bridge.errors import BridgeError, ConfigError, VersionError
from bridge.failpoints import failpoint
from bridge.log import get_logger
from bridge.lora.config import AdapterPublisherConfig, AdapterPublishResult, adapter_key
from bridge.lora.gather import DISK_WORK, Checksums, gather_adapter_tensors
from bridge.lora.servers import AdapterServers
from bridge.publisher.agreement import STEP_ATTR, in_step, raise_agreed
from bridge.publisher.bounded import SLACK_S
from bridge.publisher.lifecycle import Publisher
from bridge.snapshot.adapter import (
    ADAPTER_FILE,
    CURRENT_LINK,
    point_current,
    remove_old_versions,
    sync_adapter_dir,
    write_adapter_dir,
)
from bridge.tensors import dtype_from_str

__all__ = ["AdapterPublishResult", "AdapterPublisher", "AdapterPublisherConfig", "adapter_key"]

logger = get_logger(__name__)

@dataclass(slots=True)
class _Published:
    """Rank 0's record of a version the servers serve: what a failed publish loads back."""

    version: int
    path: str | None
    config: dict
    tensors: dict[str, torch.Tensor] | None
    pending_checksums: Checksums | None
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


class AdapterPublisher(Publisher):
    """Publishes versions of one LoRA adapter (see the module docstring). Collective: every rank builds it
    and calls :meth:`publish` with the same version. What it shares with the weights' publisher (config, agreement,
    version rule, Ctrl-C, run): :class:`bridge.publisher.lifecycle.Publisher`."""

    config_class = AdapterPublisherConfig

    def __init__(self, config: AdapterPublisherConfig | None = None, **kwargs):
        super().__init__(config, kwargs)
        config = self.config
        self._tried = False  # a publish ran steps with the other ranks: close() meets them once more
        self._served: _Published | None = None  # rank 0
        self._warned: set[str] = set()  # real SGLang servers told that a tensors replace refuses generations
        self._fleet = AdapterServers(config)  # rank 0: found, probed and held at every publish
        self._name_resolve = None  # rank 0, disk
        self._loaded_into: list = []  # rank 0: the servers that loaded the version being published
        self._announced: str | None = None  # rank 0: its announcement key, once made
        self._phases: dict[str, float] = {}
        self._at = ""  # the step in progress, named by a failure no part of it marked
        self._removing = None  # rank 0, disk: the removal of old directories, left running by the last commit
        self._syncing = None  # rank 0, disk: the fsyncs of the directory being published (:meth:`_write`)
        self._reusable: _Published | None = None  # rank 0: a gather's buffer no one uses any more, the next one's memory
        self._group = None  # rank 0, broadcast: the servers' weight-update group (bridge.lora.broadcast)

    def publish(self, source, version: int) -> AdapterPublishResult:
        """Publish ``source``'s adapter as ``version`` (collective: every trainer rank calls it).

        Raises (the same error on every rank):
            VersionError: ``version`` is older than the last one published, or the last one with other weights.
            ConfigError: the source has no adapter, or a setting is wrong.
            SyncError / SyncTimeout / SnapshotError / NameResolveError: the publish failed; every server
                serves the previous adapter version.
        """
        return super().publish(source, version)

    def _publish(self, source, version: int) -> AdapterPublishResult:
        """The three agreed steps (prepare, gather, load), each bounded, every rank raising the same error; a failure
        after prepare undoes on every rank what was done (:meth:`_undo`)."""
        t0 = time.perf_counter()
        self._phases, self._tried = {}, True
        self._removed()
        new = _Published(version, None, {}, None, None)  # rank 0: filled by the gather, then the write
        self._loaded_into, self._announced = [], None
        began, self._at = False, "adapter:prepare"
        try:
            prepare = functools.partial(self._part, "adapter:prepare", functools.partial(self._prepare, source, version))
            specs = self._step_on_every_rank("adapter:prepare", prepare, SLACK_S)[0]
            began = True
            return self._gather_and_load(source, version, specs, new, t0)
        except BridgeError as e:
            if began:
                self._undo(new)
            at = getattr(e, STEP_ATTR, None) or self._at  # the part that failed, else the step
            raise_agreed(e, type(e)(f"adapter {self.config.name!r}: publish failed at {at}: {e}"))

    def _gather_and_load(self, source, version: int, specs, new: _Published, t0: float) -> AdapterPublishResult:
        cfg = self.config
        dtype = dtype_from_str(cfg.dtype) if cfg.dtype is not None else None

        def gather() -> tuple[int, dict | None]:
            """The collective gather (every rank joins it, then agrees on it before rank 0 loads anything); then,
            on rank 0, the servers of this publish, whose number bounds the next step on every rank; or, for the
            last version published again, the checksums it was published with when these are the same weights."""
            reuse = self._take_reusable()
            got = self._part("adapter:gather", lambda: gather_adapter_tensors(source, dtype, cfg.via == "tensors", reuse),
                             point_after=True) or {}
            new.config, new.pending_checksums = got.get("config", {}), got.get("checksums")
            new.tensors, new.buffer = got.get("tensors"), got.get("buffer")
            if self._versions.is_retry(version):
                return 0, self._part("adapter:retry", lambda: self._same_weights(new))
            found = self._part("adapter:servers", self._find_servers)
            self._part("adapter:lease", self._hold_servers)
            return found, None

        self._at = "adapter:gather"
        found, served = self._step_on_every_rank(self._at, gather, cfg.gather_timeout + cfg.http_timeout)[0]
        if served is not None:  # the servers serve these weights under this version already: nothing to load
            self._reusable = _Published(version, None, {}, None, new.pending_checksums, new.buffer)
            return AdapterPublishResult(cfg.name, version, cfg.via, sum(s[1] for s in specs), time.perf_counter() - t0,
                                        self._served.path if self._served is not None else None, served,
                                        dict(self._phases), retried=True)

        def deliver():
            """Rank 0: write the directory (disk), load it into every server, announce it (disk); every rank: the
            commit's fault point. One agreed step: a failure of any part on any rank undoes what was done."""
            if cfg.via == "disk":
                new.path = self._part("adapter:write", lambda: self._write(version, new.tensors, new.config))
                new.tensors = None  # the servers load the directory; the tensors are not kept, their buffer is spare
                self._reusable = _Published(version, None, {}, None, new.pending_checksums, new.buffer)
            self._part("adapter:load", lambda: self._load_all(new))
            if cfg.via == "disk":
                self._part("adapter:announce", lambda: self._announce(new))
            return self._part("adapter:commit", lambda: new.checksums)

        bound = cfg.http_timeout * (1 + found + (2 if cfg.via == "disk" else 0))  # + the write and the announcement
        if cfg.via == "broadcast":  # + the group's rendezvous and the broadcast
            bound += 2 * cfg.group_timeout
        self._at = "adapter:load"
        checksums = self._step_on_every_rank(self._at, deliver, bound)[0]
        self._committed(new)
        return AdapterPublishResult(cfg.name, version, cfg.via, sum(s[1] for s in specs), time.perf_counter() - t0,
                                    new.path, checksums, dict(self._phases))

    def close(self) -> None:
        """Close the server connections and name resolution (the servers keep serving the adapter). Collective
        once a publish was tried, committed or failed: rank 0 waits (a few seconds at most) until every rank read the
        last outcome, so that its exit does not take the ranks' store away from a rank still reading a failure."""
        if self._tried:
            self._agree.finish(SLACK_S)
            self._tried = False
        self._removed()
        if self._group is not None:
            self._group.teardown()
            self._group = None
        self._fleet.close()
        if self._name_resolve is not None:
            self._name_resolve.close()
        self._name_resolve = None

    # ---------------------------------------------------------------- steps

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

    def _same_weights(self, new: _Published) -> dict | None:
        """Rank 0, the last version published again: its checksums when ``new`` holds the same weights (a safe
        retry); other weights under a published version are a VersionError. None elsewhere."""
        if self._rank != 0:
            return None
        served = self._served.checksums if self._served is not None else None
        if served is None or new.checksums != served:
            raise VersionError(f"adapter {self.config.name!r}: version {new.version} was already published with other "
                               "weights; publish a higher version (retrying a version with the same weights is safe)")
        return served

    def _names(self):
        """Rank 0: name resolution, opened once."""
        if self._name_resolve is None:
            from bridge.name_resolve import DEFAULT_URL, make_name_resolve

            self._name_resolve = make_name_resolve(self.config.name_resolve or DEFAULT_URL)
        return self._name_resolve

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
        self._syncing = DISK_WORK.submit(sync_adapter_dir, path)
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
        """Rank 0: the servers of this publish (:meth:`bridge.lora.servers.AdapterServers.find`); their number."""
        return self._fleet.find() if self._rank == 0 else 0

    def _hold_servers(self) -> None:
        """Rank 0: the servers, for this writer alone until the publish committed or was undone."""
        if self._rank == 0:
            self._fleet.take()

    def _load_all(self, new: _Published) -> None:
        """Rank 0: every server loads ``new`` (the ones that did are recorded, for :meth:`_undo`)."""
        if self._rank != 0:
            return
        if self.config.via == "broadcast":
            self._broadcast_all(new)
            return
        for i, client in enumerate(self._fleet.clients()):
            failpoint(f"adapter:load:{i}", 0)
            self._loaded_into.append(client)  # before the call: a server that timed out may have loaded it
            new.copied = new.copied and client.can.lora_copies_tensors
            self._load(client, new)

    def _load(self, client, p: _Published) -> None:
        """One server loads ``p`` under the stable name, replacing what it serves there in one step
        (:class:`bridge.client.lora.LoraRoutes`)."""
        name = self.config.name
        if p.path is not None:
            # Real SGLang replaces by unload-then-load and reloads an unloaded name from its last path for a
            # generation asking for it in between: a stable path already showing this version makes that
            # generation get it (bridge.client.lora), never a refusal nor the old version.
            reloads = client.can.lora_replace != "one step"  # it may reload the name from its path in between
            if reloads:
                self._durable()  # `current` only ever points at a durable directory
            path = point_current(p.path) if reloads else p.path
            client.load_adapter_from_path(name, path, version=str(p.version), replace=True)
        else:
            if client.can.lora_replace != "one step" and client.url not in self._warned:
                self._warned.add(client.url)
                logger.warning("adapter %r by tensors into real SGLang %s: a generation asking for it while it is "
                               "replaced is refused (SGLang cannot reload a tensors adapter); via='disk' refuses none",
                               name, client.url)
            client.load_adapter_from_tensors(name, p.config, p.tensors, version=str(p.version), replace=True,
                                             checksums=p.checksums)

    def _broadcast_all(self, new: _Published) -> None:
        """Rank 0, broadcast: every server loads ``new`` at once over the group (made on the first publish)."""
        from bridge.lora.broadcast import AdapterGroup, GroupLost

        clients = self._fleet.clients()
        for i in range(len(clients)):
            failpoint(f"adapter:load:{i}", 0)
        if self._group is None:
            self._group = AdapterGroup(self.config)
        self._group.ensure(clients)
        self._loaded_into.extend(clients)  # before the call: a server that timed out may have loaded it
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
        status = self._load_back(self._loaded_into)
        self._loaded_into = []
        if self._announced is not None:
            try:
                self._name_resolve.delete(self._announced)
            except Exception as e:  # reported; the publish's own error is raised
                status += f"; could not remove the announcement {self._announced}: {e}"
            self._announced = None
        if new.path is not None and (self._served is None or self._served.path != new.path):
            link = os.path.join(os.path.dirname(new.path), CURRENT_LINK)
            if os.path.islink(link) and os.readlink(link) == os.path.basename(new.path):
                os.unlink(link)  # a first version that failed: nothing to show
            shutil.rmtree(new.path, ignore_errors=True)
        self._fleet.release()  # the servers are back on the previous version: another writer may go on
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
        self._versions.committed(new.version)
        if self._rank != 0:
            return
        self._fleet.committed(new.version)  # (back) in rotation, then let go
        old, self._served, self._loaded_into, self._announced = self._served, new, [], None
        if old is not None and old.tensors is not None and old.copied:  # by tensors: no server holds its buffer
            self._reusable = old
        if new.path is not None:  # in the background (a few ms of unlinks): done before the next publish or close()
            self._removing = DISK_WORK.submit(remove_old_versions, os.path.dirname(new.path), self.config.keep)

    def _take_reusable(self) -> torch.Tensor | None:
        """Rank 0: the spare buffer to gather into (its checksums, which read it, finished first), or None."""
        spare, self._reusable = self._reusable, None
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
