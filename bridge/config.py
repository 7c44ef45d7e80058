"""How and where to publish: :class:`PublisherConfig`, the settings every transport shares, and the options
of the chosen one.

Each transport declares its own options as a small dataclass (``Transport.Options``, checked in its own
``__post_init__``: :class:`bridge.transports.base.SessionOptions`, ``BroadcastOptions``, ``DiskOptions``).
``PublisherConfig`` takes them either as that object (``options=DiskOptions(disk_writers="rank0")``) or
as flat keywords, as it always has (``PublisherConfig(transport="disk", disk_writers="rank0")``), and
reads them back as attributes (``config.disk_writers``). A keyword that is an option of another
transport is a ConfigError naming the transport it belongs to (it would have no effect), and so is a
keyword no transport knows.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bridge.encodings import encoding_class
from bridge.errors import ConfigError
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL
from bridge.tensors import dtype_from_str
from bridge.transports.registry import option_fields, transport_class

__all__ = ["PublisherConfig"]


def _default_bucket_mb() -> float:
    """512 with CUDA, else 32"""
    # Enough bytes per HTTP round trip, and several buckets per model so the gather of one overlaps the
    # send of the previous one. On 2 CPU cores 32 MiB measured fastest on both bench presets
    # (wsync bench); NCCL links want larger buckets.
    return 512.0 if torch.cuda.is_available() else 32.0


@dataclass(kw_only=True, init=False)
class PublisherConfig:
    """How and where to publish: the settings every transport shares, and ``options``, the chosen
    transport's own (see the module docstring). Checked when built.

    Every argument is a keyword: the shared settings (the signature lists them with their defaults; each is
    documented where it is declared, in ``bridge/config.py``), then ``options``, or the chosen transport's
    options as flat keywords (``bridge.transports.option_fields()`` lists them with the transports that take
    them; another transport's option is a ConfigError).
    """

    transport: str = "broadcast"
    """A registered transport (``bridge.transports.transport_names()``): ``broadcast`` (alias ``nccl``), a
    custom process group, one broadcast per bucket; ``colocated``, servers on this host, buckets handed
    over by reference; ``disk``, HF snapshots announced in name resolution."""
    servers: Sequence[str] = ()
    """Base URLs of the servers (a fixed list; or, with ``server_registry``, found at every publish)."""
    server_registry: str | Sequence[str] | None = None
    """Where the servers are found, read again at the start of every publish: ``etcd://host:port`` or
    ``file:///dir`` (servers registered under ``wsync/<experiment>/<trial>/servers/``), or
    ``router+http://host:port`` (the workers of an sglang-router or smg); several for a registry and the
    router that is the rotation (docs/fleet.md)."""
    min_servers: int = 1
    """A publish fails when fewer servers than this answer, or take the version (a dead one is excluded)."""
    probe_timeout: float = 5.0
    """Seconds each server has to answer the probe before every sync (at most ``http_timeout``)."""
    experiment: str = DEFAULT_EXPERIMENT
    """Experiment name: part of the run id servers see and of the announcement keys."""
    trial: str = DEFAULT_TRIAL
    """Trial name: part of the run id servers see and of the announcement keys."""
    bucket_mb: float = field(default_factory=_default_bucket_mb)
    """Byte budget of one bucket, in MiB. Rank 0 holds at most about two buckets."""
    serving_dtype: str = "bfloat16"
    """dtype the servers serve; weights are cast to it on the way (fp32 master -> bf16)."""
    backend: str | None = None
    """``nccl`` or ``gloo`` for the trainer's gathers and the weight-update group; default: nccl with
    CUDA, gloo without."""
    http_timeout: float = 60.0
    """Seconds for each HTTP call to a server."""
    group_timeout: float = 60.0
    """Seconds for a group rendezvous and for each gather or broadcast to complete."""
    api_key: str | None = None
    """Bearer key for the servers' ``--api-key`` (every route; the control routes too unless ``admin_api_key``)."""
    admin_api_key: str | None = None
    """Bearer key for the servers' ``--admin-api-key``: SGLang's control routes then accept only this key."""
    progress: bool = True
    """Show a progress bar for syncs that take longer than a second."""
    new_run: bool = False
    """This publisher starts a new run: its first publish may go below the version the servers serve (a
    restarted trainer counting from 1 again). Without it the reference server refuses a version older
    than the served one unless ``experiment``/``trial`` (the run id it is sent) changed."""
    encoding: str = "full"
    """How each sync's bytes are formed (:mod:`bridge.encodings`): ``full``, every tensor; ``delta`` (broadcast
    and colocated), what changed since the version the servers serve, with a full sync (an anchor) when
    there is no base, a server is on another version, the delta would cost more than a full sync, or every
    ``delta_anchor_every`` versions."""
    delta_anchor_every: int = 50
    """With ``encoding="delta"``: at least every this many versions, a full sync. At 2-10 % delta bytes an
    anchor every 50 versions adds about 2 % to the bytes moved on average."""
    delta_max_fraction: float = 0.5
    """With ``encoding="delta"``: a delta larger than this fraction of the full bytes is always sent as a
    full sync. Below it the measured costs decide (:mod:`bridge.delta_cost`: the delta's bytes at what the
    last syncs paid per byte, plus its diff, against the last full syncs' time), since where a delta pays
    depends on the link: on CPU loopback one of 15 % of the bytes took 1.26 of the full sync's time, over a
    200 Mbit/s link far less. Each rank estimates it from a sample first, so a sync that will be full skips
    the diff."""
    fp8_skip: tuple = ()
    """With ``encoding="fp8"``: regular expressions of module names to leave in the serving dtype besides the rule
    of :mod:`bridge.fp8` (``layers\\.0\\.``, say); the servers must be started with the same ``--fp8-skip``."""
    options: Any = None
    """The transport's options (an instance of ``transport_class(transport).Options``); built from the
    flat keywords when not given."""

    def __init__(self, *, options: Any = None, **keywords: Any):
        shared = {f.name for f in dataclasses.fields(self)} - {"options"}
        for f in dataclasses.fields(self):
            if f.name in shared:
                value = keywords.pop(f.name) if f.name in keywords else (
                    f.default if f.default is not dataclasses.MISSING else f.default_factory())
                setattr(self, f.name, value)
        cls = transport_class(self.transport)  # an unknown name is a ConfigError listing the known ones
        self.transport = cls.name  # aliases resolved
        self.options = _options(cls, options, keywords)
        self._check()
        cls.check_config(self)
        encoding_class(self.encoding).check_config(self, cls)

    @classmethod
    def keywords(cls, transport: str | None = None) -> set[str]:
        """The keywords the constructor takes for ``transport``: the shared settings and that transport's
        options; without ``transport``, for some transport (every registered transport's options)."""
        shared = {f.name for f in dataclasses.fields(cls)}
        if transport is None:
            return shared | {o.name for o in option_fields()}
        return shared | {f.name for f in dataclasses.fields(transport_class(transport).Options)}

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not attributes: the options read as the config's own.
        options = self.__dict__.get("options")
        if options is not None and name in {f.name for f in dataclasses.fields(options)}:
            return getattr(options, name)
        raise AttributeError(f"PublisherConfig has no setting {name!r} for the {self.__dict__.get('transport')} transport")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)

    def _check(self) -> None:
        if isinstance(self.servers, str):
            raise ConfigError(f"servers must be a list of URLs, got the string {self.servers!r}")
        self.servers = [s.rstrip("/") for s in self.servers]
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        dtype_from_str(self.serving_dtype)
        for name in ("http_timeout", "group_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if isinstance(self.server_registry, str) or self.server_registry is None:
            registries = [self.server_registry] if self.server_registry else []
        else:
            registries = self.server_registry = list(self.server_registry)
        from bridge.fleet.discovery import check_registry_url

        for url in registries:
            check_registry_url(url)
        if isinstance(self.min_servers, bool) or not isinstance(self.min_servers, int) or self.min_servers < 1:
            raise ConfigError(f"min_servers must be an integer >= 1, got {self.min_servers!r}")
        if not self.probe_timeout > 0:
            raise ConfigError(f"probe_timeout must be a positive number of seconds, got {self.probe_timeout}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ConfigError(f"backend must be nccl or gloo (or None: nccl with CUDA, gloo without), got {self.backend!r}")


def _options(cls, options: Any, keywords: dict[str, Any]) -> Any:
    """The transport's options object, from ``options`` or the flat keywords (see the module docstring)."""
    own = {f.name for f in dataclasses.fields(cls.Options)}
    if options is not None:
        if not isinstance(options, cls.Options):
            raise ConfigError(f"options for the {cls.name} transport must be a {cls.Options.__name__}, "
                              f"got {type(options).__name__}")
        clash = sorted(own & set(keywords))
        if clash:
            raise ConfigError(f"{clash} given both as keywords and in options=; give each once")
    others = {o.name: o.transports for o in option_fields()}
    unknown = sorted(set(keywords) - own - set(others))
    if unknown:
        raise ConfigError(f"PublisherConfig got unknown keyword(s) {unknown}; known: {sorted(PublisherConfig.keywords())}")
    foreign = sorted(set(keywords) - own)
    if foreign:
        raise ConfigError("; ".join(f"{name} is an option of the {_names(others[name])}, not of {cls.name}"
                                    for name in foreign)
                          + f" (the {cls.name} transport's options: {sorted(own) or 'none'})")
    if options is not None:
        return options
    return cls.Options(**{k: v for k, v in keywords.items() if k in own})


def _names(transports: tuple[str, ...]) -> str:
    """``disk transport``, ``broadcast and colocated transports``, ``a, b and c transports``."""
    if len(transports) == 1:
        return f"{transports[0]} transport"
    return f"{', '.join(transports[:-1])} and {transports[-1]} transports"


class _Described:
    """A default shown by its description (one computed when the config is built)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature() -> inspect.Signature:
    """The constructor as ``help()`` and editors should show it: each shared setting, ``options``, then
    the chosen transport's options as ``**transport_options``."""
    params = []
    for f in dataclasses.fields(PublisherConfig):
        if f.name == "options":
            continue
        default = f.default if f.default is not dataclasses.MISSING else _Described(f.default_factory.__doc__)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    params.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Any"))
    params.append(inspect.Parameter("transport_options", inspect.Parameter.VAR_KEYWORD, annotation="Any"))
    return inspect.Signature(params)


PublisherConfig.__signature__ = _signature()
PublisherConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *PublisherConfig.__signature__.parameters.values()])
