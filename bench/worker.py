"""The trainer side of ``wsync bench``: every rank of the torchrun job runs :func:`run_worker`; rank 0 measures.

One model size per job. The job shards the model with FSDP2 (:class:`trainer.FSDPEngine`) and then runs
rounds over the *items* below; round 0 is the warm-up (reported as each item's ``first``), rounds
1..repeats are timed. Items of one round run back to back, so noise from the shared machine lands on
every method alike. Every item starts after a barrier, and rank 0 times it with ``time.perf_counter``.

Methods (each is one ``WeightPublisher.publish``, collective on every rank):

- ``flat-<N>MiB``: broadcast of flattened buckets of N MiB. One publisher serves every broadcast
  method, its ``bucket_mb``/``load_format`` switched between publishes, so only the very first publish
  pays the weight-update group's creation (``phases["group_init"]``).
- ``per-tensor``: the same publisher with ``load_format="per_tensor"`` and a tiny ``bucket_mb``: one
  ``/update_weights_from_distributed`` request and one broadcast per tensor.
- ``colocated-<N>MiB``: buckets of N MiB (the first bucket size) handed over in /dev/shm files
  (``spec["colocated"]``, on by default).
- ``fp8-<N>MiB``, ``gather-fp8-<N>MiB``, ``raw-broadcast-fp8`` (``spec["fp8_server"]``, on by default): the
  flattened broadcast with ``encoding="fp8"`` into a server serving FP8, its bucket fills alone, and its floor,
  the FP8 bytes in one broadcast to that server (:mod:`bench.fp8`).
- ``delta-lr<LR>`` (``spec["delta_server"]``): a delta sync after one optimizer step at LR (:mod:`bench.delta`).
- ``lora-tensors``, ``lora-disk`` (``spec["lora_server"]``, on by default): a LoRA adapter of the same model
  (rank ``spec["lora_rank"]`` on every projection) published alone by tensors and by disk (:mod:`bench.lora`).
- ``disk-<backend>``: snapshot write + fsync + announcement + load, ``wait_loaded=True``; a watcher in
  the driver process loads each announced version into the server. ``disk-dir-rank0`` (when the
  publisher has ``disk_writers`` and there are 2+ ranks): the same with rank 0 writing every file, the
  baseline of the default where every rank writes its share.

Gathers, every method's first half, timed alone (every rank): ``gather-<N>MiB`` and
``gather-per-tensor`` run :meth:`trainer.FSDPEngine.gather_bucket` over the same bucket plan as the
method of that budget (the publisher's own gather: flat pieces of FSDP2 shards to rank 0), into
buffers allocated as a transport does (one per bucket, on the transport's device: ``-host`` names a
gather into host memory on a CUDA trainer, as colocated and disk do), and send nothing.
Each method record names its gather item (``gather_item``); the report subtracts it, round by round,
to give the method's *transfer only* time.

Floors, on the same bytes ``B`` (the model in the serving dtype), in the same processes:

- ``raw-gather`` (every rank): one ``all_gather_into_tensor`` (``all_gather_single``) of a flat buffer
  of ``B`` bytes in the serving dtype on the default group, the traffic FSDP's gathers carry; and
  ``raw-gather-16MiB``, the same buffer in consecutive 16 MiB gathers. The floor takes the faster of
  the two in each round.
- ``raw-broadcast`` (rank 0): one ``uint8`` broadcast of ``B`` bytes to the server over a custom group
  of the same kind as the publisher's (``wsync_bench_raw``), received and dropped by the server's
  ``POST /wsync/bench/recv_raw``; timed from posting the request to the end of both.
- ``raw-shm`` (rank 0, with colocated): create a ``B``-byte file in /dev/shm with its space reserved,
  copy ``B`` bytes into its mapping, then copy them out of a fresh read-only mapping (what the server's
  ``wsync_shm`` load does); write and read are also timed separately.
- ``raw-disk`` (rank 0): ``safetensors`` write of one ``B``-byte tensor, fsync of the file and its
  directory, then ``load_file`` back and copied out (which is what reads the mapped file); write and read
  are also timed separately.

Buffers of the floors are allocated and touched before the clock starts: a floor is the transport alone.

Devices: the engine runs on CUDA with NCCL where CUDA is visible (the driver decides what each
process sees, see :mod:`bench.run`), else on the CPU with gloo. ``spec["backend"]`` overrides the
backend of the trainer-to-server groups (the publisher's and the raw floor's): ``gloo`` when the server
has no GPU of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from bridge.errors import BridgeError, ConfigError
from bridge.log import get_logger
from bridge.tensors import dtype_from_str, host_buffer

__all__ = ["EXPERIMENT", "RAW_GROUP", "run_worker"]

logger = get_logger(__name__)

EXPERIMENT = "wsync-bench"
"""Experiment name of the disk announcements (the trial names the size and the backend)."""
RAW_GROUP = "wsync_bench_raw"
"""Name of the custom group used for the raw broadcast floor."""
GATHER_CHUNK_MB = 16
"""The raw gather is also timed as consecutive gathers of this many MiB: on gloo/CPU one call over a few
hundred MB can be slower than the same bytes in pieces, and a floor must be the faster way."""
RECV_RAW_ROUTE = "/wsync/bench/recv_raw"  # inference_adapter.bench_routes.RECV_RAW_ROUTE, without importing fastapi


def run_worker(spec: dict) -> int:
    """Run one size's measurements on this rank; rank 0 writes ``spec["out"]``. Returns the exit code."""
    from trainer import EngineConfig, FSDPEngine

    engine = FSDPEngine(EngineConfig(model_path=spec["model_dir"])).initialize()
    bench = None
    try:
        bench = _Bench(engine, spec)
        if spec.get("profile"):
            from bench.phase_timer import profile_method

            result = profile_method(bench, **spec["profile"])
        else:
            result = bench.run()
        if engine.rank == 0:
            tmp = spec["out"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, spec["out"])
    finally:
        if bench is not None:
            bench.close()
        engine.destroy()
    return 0


class _Bench:
    def __init__(self, engine, spec: dict):
        from bridge import PublisherConfig, WeightPublisher

        self.engine, self.spec = engine, spec
        self.rank0 = engine.rank == 0
        self.url = spec["server"]
        self.floor_url = spec.get("floor_server") or self.url  # where the raw broadcast floor goes (a reference server)
        self.sglang = spec.get("engine") == "sglang"
        self.device = engine.device
        dtype = dtype_from_str(spec["serving_dtype"])
        self.wire = [s.with_dtype(dtype) if s.dtype.is_floating_point else s for s in engine.param_specs()]
        self.nbytes = sum(s.nbytes for s in self.wire)
        self.versions = itertools.count(1)
        self.timeout = float(spec.get("timeout", 120.0))
        common = dict(servers=[self.url], serving_dtype=spec["serving_dtype"], progress=False,
                      http_timeout=self.timeout, group_timeout=self.timeout)
        self.backend = spec.get("backend")  # None: NCCL on CUDA, gloo on CPU (the publisher's default)
        if self.backend:
            common["backend"] = self.backend
        self.broadcast = WeightPublisher(PublisherConfig(transport="broadcast", bucket_mb=spec["buckets_mb"][0], **common))
        self.colocated = None
        self.skipped: dict[str, str] = {}
        if spec.get("colocated", True) and self._shm_short(spec["buckets_mb"][0]):
            self.skipped["colocated"] = self._shm_short(spec["buckets_mb"][0])
            if self.rank0:
                print(f"wsync bench: colocated not measured: {self.skipped['colocated']}", file=sys.stderr, flush=True)
        elif spec.get("colocated", True):
            self.colocated = WeightPublisher(PublisherConfig(transport="colocated", bucket_mb=spec["buckets_mb"][0],
                                                             **common))
        self.disks = {
            d["backend"]: WeightPublisher(PublisherConfig(
                transport="disk", experiment=EXPERIMENT, trial=d["trial"], name_resolve=d["name_resolve"],
                snapshot_root=d["snapshot_root"], keep_snapshots=2, wait_loaded=True, wait_loaded_timeout=self.timeout,
                **({"disk_writers": d["disk_writers"]} if "disk_writers" in d else {}), **common))
            for d in spec["disk"]
        }
        self.delta = None  # the delta rows (bench.delta), into a server of their own
        if spec.get("delta_server"):
            from bench.delta import DeltaRows

            self.delta = DeltaRows(self, spec, common)
        self.fp8 = None  # the FP8 rows (bench.fp8), into a server serving FP8 of its own
        if spec.get("fp8_server"):
            from bench.fp8 import Fp8Rows

            self.fp8 = Fp8Rows(self, spec, common)
        self.lora = None  # the LoRA rows (bench.lora): an adapter of the same model into a server of its own
        if spec.get("lora_server"):
            from bench.lora import LoraRows

            self.lora = LoraRows(self, spec)
        # The device the broadcast transport gathers into (BroadcastTransport.buffer): CUDA only under NCCL.
        self.wire_device = self.device if (self.backend or _default_backend()) == "nccl" else torch.device("cpu")
        # The bench's own gathers run on a group of their own, as the publisher's do.
        self.gather_group = (dist.new_group(backend=self.backend or _default_backend())
                             if engine.world_size > 1 else None)
        self.raw_pgs: dict[str, tuple] = {}  # server URL -> (group, its name): the raw broadcast floor's group to it
        self.pool = cf.ThreadPoolExecutor(2, thread_name_prefix="bench-http") if self.rank0 else None
        os.makedirs(spec["floor_dir"], exist_ok=True)

    # ------------------------------------------------------------------ the run

    def items(self) -> list[tuple[str, Callable[[], dict | None]]]:
        """(name, function) of everything timed in one round, in the order the round runs them."""
        spec = self.spec
        out: list[tuple[str, Callable[[], dict | None]]] = [
            ("raw-gather", self._raw_gather),
            (f"raw-gather-{GATHER_CHUNK_MB}MiB", lambda: self._raw_gather(GATHER_CHUNK_MB << 20)),
            ("raw-broadcast", self._raw_broadcast),
        ]
        if self.colocated is not None:
            out.append(("raw-shm", self._raw_shm))
        for name, (budget, device) in self.gather_budgets().items():
            out.append((name, lambda b=budget, d=device: self._gather_only(b, d)))
        for mb in spec["buckets_mb"]:
            out.append((f"flat-{mb:g}MiB", lambda mb=mb: self._publish_broadcast("flattened_bucket", mb)))
        if self.sglang:  # what a publisher sends real SGLang by default: the whole sync as one request (atomic_mb)
            mb = spec["buckets_mb"][0]
            out.append((f"one-request-{mb:g}MiB", lambda mb=mb: self._publish_broadcast("auto", mb, atomic=True)))
        out += self.fp8.items() if self.fp8 is not None else []
        out += self.delta.items() if self.delta is not None else []
        out += self.lora.items() if self.lora is not None else []
        out.append(("per-tensor", lambda: self._publish_broadcast("per_tensor", spec["per_tensor_bucket_mb"])))
        if self.colocated is not None:
            out.append((f"colocated-{self.colocated.config.bucket_mb:g}MiB", self._publish_colocated))
        out.append(("raw-disk", self._raw_disk))
        for backend in self.disks:
            out.append((f"disk-{backend}", lambda b=backend: self._publish_disk(b)))
        return out

    def gather_budgets(self) -> dict[str, tuple[int, torch.device]]:
        """gather item name -> (bucket budget in bytes, buffer device), one per bucket plan and device some
        method uses: broadcast gathers into ``wire_device`` buffers, colocated and disk into host memory."""
        wire = self.wire_device
        budgets = {_gather_name(int(mb * 2**20), wire): (int(mb * 2**20), wire) for mb in self.spec["buckets_mb"]}
        per_tensor = int(self.spec["per_tensor_bucket_mb"] * 2**20)
        budgets[_gather_name(per_tensor, wire, per_tensor=True)] = (per_tensor, wire)
        pubs = [self.colocated] if self.colocated is not None else []
        cpu = torch.device("cpu")
        for pub in pubs + list(self.disks.values()):
            budgets.setdefault(_gather_name(pub.config.bucket_bytes, cpu), (pub.config.bucket_bytes, cpu))
        return budgets

    def run(self) -> dict | None:
        items = self.items()
        if self.rank0:
            self._check_route()
        records: dict[str, dict] = {name: {"first": None, "runs": []} for name, _ in items}
        repeats = int(self.spec["repeats"])
        t_start = time.perf_counter()
        for rnd in range(repeats + 1):
            for name, fn in items:
                dist.barrier()
                rec = fn()
                if self.rank0:
                    if rnd == 0:
                        records[name]["first"] = rec
                    else:
                        records[name]["runs"].append(rec)
            if self.rank0:
                what = "warm-up" if rnd == 0 else f"round {rnd}/{repeats}"
                print(f"wsync bench: {self.spec['label']}: {what} done ({time.perf_counter() - t_start:.0f} s)",
                      file=sys.stderr, flush=True)
        if not self.rank0:
            return None
        params = sum(s.numel for s in self.wire)
        return {
            "label": self.spec["label"], "model_dir": self.spec["model_dir"], "params": params, "bytes": self.nbytes,
            "tensors": len(self.wire), "world_size": self.engine.world_size, "backend": dist.get_backend(),
            "device": str(self.device), "server_backend": self.backend or _default_backend(),
            "serving_dtype": self.spec["serving_dtype"], "repeats": repeats, "items": records,
            "seconds_total": time.perf_counter() - t_start, "skipped": self.skipped,
            "engine": self.spec.get("engine", "reference"),
        }

    def _shm_short(self, bucket_mb: float) -> str | None:
        """Why /dev/shm cannot hold the colocated method and its floor (the model's bytes, then two
        buckets), or None. The same answer on every rank: they share the host."""
        import shutil

        from bridge.log import fmt_bytes
        from bridge.transports.shm import shm_dir

        need = self.nbytes + 3 * int(bucket_mb * 2**20)
        free = shutil.disk_usage(shm_dir()).free
        if free >= need:
            return None
        return (f"{shm_dir()} has {fmt_bytes(free)} free, the shm floor and two buckets need {fmt_bytes(need)} "
                "(give the container more shared memory, e.g. docker --shm-size)")

    def close(self) -> None:
        self.broadcast.close()
        for rows in (self.delta, self.fp8, self.lora):
            if rows is not None:
                rows.close()
        if self.colocated is not None:
            self.colocated.close()
        for pub in self.disks.values():
            pub.close()
        for url, (pg, name) in list(self.raw_pgs.items()):
            from bridge.client import ServerClient
            from bridge.process_group import destroy_custom_process_group

            del self.raw_pgs[url]
            destroy_custom_process_group(pg)
            try:
                ServerClient(url, timeout=10).destroy_weights_update_group(group_name=name)
            except BridgeError as e:
                logger.debug("destroying %s on %s: %s", name, url, e)
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    # ------------------------------------------------------------------ methods

    def _publish_broadcast(self, load_format: str, bucket_mb: float, atomic: bool = False) -> dict | None:
        """The broadcast publisher with ``load_format`` and ``bucket_mb``, bucket by bucket (one request per bucket, or
        per tensor: the seed's way), or with ``atomic`` the whole sync as one request where the server loads as it
        receives (real SGLang)."""
        cfg = self.broadcast.config
        cfg.options.load_format, cfg.bucket_mb = load_format, bucket_mb
        cfg.options.atomic_mb = 1e9 if atomic else 0
        gather = _gather_name(cfg.bucket_bytes, self.wire_device, per_tensor=load_format == "per_tensor")
        return self._publish(self.broadcast, gather)

    def _publish_colocated(self) -> dict | None:
        return self._publish(self.colocated, _gather_name(self.colocated.config.bucket_bytes, torch.device("cpu")))

    def _publish_disk(self, backend: str) -> dict | None:
        pub = self.disks[backend]
        return self._publish(pub, _gather_name(pub.config.bucket_bytes, torch.device("cpu")))

    def _publish(self, pub, gather_item: str) -> dict | None:
        """One timed publish; rank 0's record of it (None on the other ranks)."""
        from bridge.buckets import plan_buckets

        cfg = pub.config
        t0 = time.perf_counter()
        res = pub.publish(self.engine, version=next(self.versions))
        seconds = time.perf_counter() - t0
        if not self.rank0:
            return None
        largest = max(b.nbytes for b in plan_buckets(self.wire, cfg.bucket_bytes))
        rec = {"seconds": seconds, "bytes": res.bytes, "buckets": res.buckets, "peak_extra_bytes": res.peak_extra_bytes,
               "bucket_bytes": cfg.bucket_bytes, "largest_bucket_bytes": largest, "phases": res.phases,
               "gather_item": gather_item}
        if res.path:
            rec["path"] = res.path
        return rec

    def _gather_only(self, bucket_bytes: int, device: torch.device) -> dict | None:
        """The publisher's gather of every bucket of this budget's plan into ``device`` buffers, alone:
        nothing is sent."""
        from bridge.buckets import plan_buckets

        buckets = plan_buckets(self.wire, bucket_bytes)
        t0 = time.perf_counter()
        for bucket in buckets:
            buf = None
            if self.rank0:  # as the transports allocate: host buckets pinned on a CUDA trainer
                buf = host_buffer(bucket.nbytes) if device.type == "cpu" else torch.empty(
                    bucket.nbytes, dtype=torch.uint8, device=device)
            self.engine.gather_bucket(bucket, buf, group=self.gather_group)
            del buf
        self._sync()
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "bytes": self.nbytes, "buckets": len(buckets)} if self.rank0 else None

    # ------------------------------------------------------------------ floors

    def _raw_gather(self, chunk_bytes: int | None = None) -> dict | None:
        world = self.engine.world_size
        # In the serving dtype, as FSDP's gathers of the cast shards: gloo gathers uint8 at half the speed.
        dtype = dtype_from_str(self.spec["serving_dtype"])
        per_rank = -(-self.nbytes // (dtype.itemsize * world))
        step = per_rank if chunk_bytes is None else max(1, chunk_bytes // (dtype.itemsize * world))
        shard = torch.ones(per_rank, dtype=dtype, device=self.device)
        out = torch.zeros(per_rank * world, dtype=dtype, device=self.device)
        # all_gather_into_tensor, renamed all_gather_single in recent torch.
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(0, per_rank, step):
            j = min(per_rank, i + step)
            if world > 1:
                gather(out[i * world : j * world], shard[i:j])
            else:
                out[i:j].copy_(shard[i:j])
        self._sync()
        seconds = time.perf_counter() - t0
        del shard, out
        return {"seconds": seconds, "bytes": per_rank * world * dtype.itemsize} if self.rank0 else None

    def _raw_broadcast(self, url: str | None = None, nbytes: int | None = None) -> dict | None:
        """One broadcast of ``nbytes`` (default: the model's bytes) to the server at ``url`` (default: the main one)."""
        if not self.rank0:
            return None
        url, nbytes = url or self.floor_url, nbytes or self.nbytes
        first = url not in self.raw_pgs
        t_init = time.perf_counter()
        if first:  # (group names are per process: one more server, one more name)
            name = RAW_GROUP + (f"_{len(self.raw_pgs)}" if self.raw_pgs else "")
            self.raw_pgs[url] = (self._init_raw_group(url, name), name)
        pg, name = self.raw_pgs[url]
        group_init = time.perf_counter() - t_init
        buf = torch.ones(nbytes, dtype=torch.uint8, device=self.wire_device)
        t0 = time.perf_counter()
        answer = self.pool.submit(self._post, RECV_RAW_ROUTE, {"group_name": name, "nbytes": nbytes}, url)
        work = dist.broadcast(buf, src=0, group=pg, async_op=True)
        reply = answer.result(timeout=2 * self.timeout)  # the server answers once it has received every byte
        work.wait(timedelta(seconds=self.timeout))
        self._sync()
        seconds = time.perf_counter() - t0
        rec = {"seconds": seconds, "bytes": nbytes, "server_seconds": reply.get("seconds")}
        if first:
            rec["group_init"] = group_init
        return rec

    def _raw_shm(self) -> dict | None:
        if not self.rank0:
            return None
        import mmap

        import numpy as np

        from bridge.transports.colocated import shm_buffer

        data = torch.ones(self.nbytes, dtype=torch.uint8)
        dest = torch.zeros(self.nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        buf, path = shm_buffer(self.nbytes, 0)  # the colocated transport's own file: created, space reserved, mapped
        try:
            buf.copy_(data)
            del buf
            t1 = time.perf_counter()
            fd = os.open(path, os.O_RDONLY)
            try:  # as the server's wsync_shm load reads it: a read-only mapping copied out
                with mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_READ) as mm:
                    view = np.frombuffer(mm, dtype=np.uint8)
                    dest.numpy()[:] = view
                    del view
            finally:
                os.close(fd)
            t2 = time.perf_counter()
        finally:
            os.unlink(path)
        del data, dest
        return {"seconds": t2 - t0, "write_seconds": t1 - t0, "read_seconds": t2 - t1, "bytes": self.nbytes}

    def _raw_disk(self) -> dict | None:
        if not self.rank0:
            return None
        from safetensors.torch import load_file, save_file

        path = os.path.join(self.spec["floor_dir"], "raw.safetensors")
        data = torch.ones(self.nbytes, dtype=torch.uint8)
        dest = torch.zeros(self.nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        save_file({"raw": data}, path)
        _fsync(path)
        _fsync(os.path.dirname(path))
        t1 = time.perf_counter()
        # load_file maps the file lazily: copying the tensor out is what reads it (as a server's load does).
        dest.copy_(load_file(path)["raw"])
        t2 = time.perf_counter()
        nbytes = os.path.getsize(path)
        del data, dest
        os.unlink(path)
        return {"seconds": t2 - t0, "write_seconds": t1 - t0, "read_seconds": t2 - t1, "bytes": nbytes}

    # ------------------------------------------------------------------ helpers

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _post(self, route: str, body: dict, url: str | None = None) -> dict:
        import requests

        url = url or self.url
        r = requests.post(url + route, json=body, timeout=2 * self.timeout)
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text}
        if r.status_code != 200 or not data.get("success", False):
            raise ConfigError(f"{url}{route} answered HTTP {r.status_code}: {data.get('message') or data}")
        return data

    def _check_route(self) -> None:
        """Fail before anything is broadcast when the server has no raw-receive route."""
        import requests

        r = requests.post(self.floor_url + RECV_RAW_ROUTE, json={"group_name": RAW_GROUP, "nbytes": 0},
                          timeout=self.timeout)
        if r.status_code == 404:
            raise ConfigError(
                f"{self.floor_url} has no {RECV_RAW_ROUTE} route: the raw broadcast floor needs the project's "
                "reference server (`wsync serve`), not real SGLang"
            )

    def _init_raw_group(self, url: str, name: str):
        from bridge.client import ServerClient
        from bridge.process_group import find_free_port, init_custom_process_group
        from bridge.transports.broadcast import master_address_for

        # Where the servers reach this rank, as the publisher finds it: 127.0.0.1 on one host, else this host's
        # address on the way to the server (bench --link: the trainer namespace's end of the link).
        address = master_address_for([url], None)
        port = find_free_port(address)
        backend = self.backend or _default_backend()
        client = ServerClient(url, timeout=self.timeout)
        joined = self.pool.submit(lambda: client.init_weights_update_group(
            master_address=address, master_port=port, rank_offset=1, world_size=2, group_name=name,
            backend=backend, timeout=2 * self.timeout))
        pg = init_custom_process_group(master_address=address, master_port=port, world_size=2, rank=0,
                                       group_name=name, backend=backend, timeout=self.timeout)
        joined.result(timeout=2 * self.timeout)
        return pg


def _gather_name(bucket_bytes: int, device: torch.device, per_tensor: bool = False) -> str:
    """The gather item of a bucket budget (``gather-32MiB``; ``gather-per-tensor``); ``-host`` when it gathers
    into host memory while the CUDA transports gather into device memory (so on a CPU host: never)."""
    name = "gather-per-tensor" if per_tensor else f"gather-{bucket_bytes / 2**20:g}MiB"
    return name + ("-host" if device.type == "cpu" and torch.cuda.is_available() else "")


def _default_backend() -> str:
    from bridge.process_group import default_backend

    return default_backend()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
