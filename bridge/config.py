"""How and where to publish: :class:`PublisherConfig`, nested as the trainer's config is: one dataclass per
concern, each checked when built.

================  ======================  ==================================================================
group             class                   settings
================  ======================  ==================================================================
``run``           :class:`RunIdentity`    ``experiment``, ``trial``, ``new_run``
``fleet``         :class:`Fleet`          ``servers``, ``server_registry``, ``min_servers``, ``probe_timeout``
``timeouts``      :class:`Timeouts`       ``http_timeout``, ``group_timeout``
``auth``          :class:`Auth`           ``api_key``, ``admin_api_key``
``options``       ``Transport.Options``   the chosen transport's own (``DiskOptions``, ``BroadcastOptions``, ...)
``encoding_       ``Encoding.Options``    the chosen encoding's own (``DeltaOptions``, ``Fp8Options``)
options``
================  ======================  ==================================================================

Besides them, at the top: ``transport``, ``encoding``, ``bucket_mb``, ``serving_dtype``, ``backend``,
``progress``, ``metrics_port``. Every group is given either as its object (``fleet=Fleet(servers=[...])``) or as flat keywords,
alike (``PublisherConfig(transport="disk", keep_snapshots=5, servers=[...])``); a setting reads
back flat too (``config.http_timeout`` is ``config.timeouts.http_timeout``). An option of another transport
or encoding is a ConfigError naming the one it belongs to (it would have no effect), and so is a keyword
nothing knows. Every setting is an :func:`bridge.options.option` field: its default and help are written
once, there, and ``wsync train`` generates its flags from them (``wsync/flags.py``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bridge.encodings import encoding_class
from bridge.encodings.registry import encoding_names, encoding_option_fields
from bridge.errors import ConfigError
from bridge.metrics import check_metrics_port
from bridge.name_resolve import DEFAULT_EXPERIMENT, DEFAULT_TRIAL
from bridge.options import OptionField, fields_of, option
from bridge.tensors import dtype_from_str
from bridge.transports.base import SessionOptions
from bridge.transports.registry import option_fields, transport_class, transport_names

__all__ = ["Auth", "Fleet", "PublisherConfig", "RunIdentity", "Timeouts", "config_fields"]


def _default_bucket_mb() -> float:
    """512 with CUDA, else 32"""
    # Enough bytes per HTTP round trip, and several buckets per model so the gather of one overlaps the
    # send of the previous one (the figures per bucket size: docs/benchmark.md); NCCL links want
    # larger buckets.
    return 512.0 if torch.cuda.is_available() else 32.0


def _positive_seconds(group: object, *names: str) -> None:
    for name in names:
        value = getattr(group, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(kw_only=True, slots=True)
class RunIdentity:
    """Which run this publisher is: the run id the servers see and the keys its announcements go under."""

    experiment: str = option(DEFAULT_EXPERIMENT, "experiment name: part of the run id servers see and of the "
                                                 "announcement keys")
    trial: str = option(DEFAULT_TRIAL, "trial name: part of the run id servers see and of the announcement keys")
    new_run: bool = option(False, "start a new run on the servers: versions may start below the one they serve (a "
                                  "restarted trainer counting from 1 again); without it they refuse a version that "
                                  "goes back unless experiment/trial changed. Disk announcements still only go up "
                                  "per experiment/trial")


@dataclass(kw_only=True, slots=True)
class Fleet:
    """The servers: a fixed list, or where they are found at every publish, and how many must answer."""

    servers: Sequence[str] = option((), "server to publish to, its base URL (repeat for several; with "
                                        "server_registry, found at every publish besides)", flag="server",
                                    metavar="URL", many=True)
    server_registry: str | Sequence[str] | None = option(
        None, "where the servers are found, read again at every publish: etcd://host:port or file:///dir "
              "(servers registered under wsync/<experiment>/<trial>/servers/, by `wsync serve --register` or "
              "`wsync register`), router+http://host:port (the workers of an sglang-router or smg); repeat for a "
              "registry and the router that is the rotation (docs/fleet.md)", metavar="URL", many=True)
    min_servers: int = option(1, "a publish fails when fewer servers than this answer, or take the version (a dead "
                                 "one is excluded)", metavar="N")
    probe_timeout: float = option(5.0, "seconds each server has to answer the probe before every sync (at most "
                                       "http_timeout)", metavar="S")

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            raise ConfigError(f"servers must be a list of URLs, got the string {self.servers!r}")
        self.servers = [s.rstrip("/") for s in self.servers]
        if isinstance(self.server_registry, str) or self.server_registry is None:
            registries = [self.server_registry] if self.server_registry else []
        else:
            registries = self.server_registry = list(self.server_registry) or None
        from bridge.fleet.discovery import check_registry_url

        for url in registries or ():
            check_registry_url(url)
        if isinstance(self.min_servers, bool) or not isinstance(self.min_servers, int) or self.min_servers < 1:
            raise ConfigError(f"min_servers must be an integer >= 1, got {self.min_servers!r}")
        _positive_seconds(self, "probe_timeout")


@dataclass(kw_only=True, slots=True)
class Timeouts:
    """How long a call to a server and a collective may take."""

    http_timeout: float = option(60.0, "seconds for each HTTP call to a server", metavar="S")
    group_timeout: float = option(60.0, "seconds for a group rendezvous and for each gather or broadcast to "
                                        "complete", metavar="S")

    def __post_init__(self) -> None:
        _positive_seconds(self, "http_timeout", "group_timeout")


@dataclass(kw_only=True, slots=True)
class Auth:
    """The servers' bearer keys."""

    api_key: str | None = option(None, "bearer key for the servers' --api-key (every route; the control routes "
                                       "too unless admin_api_key)", metavar="KEY")
    admin_api_key: str | None = option(None, "bearer key for the servers' --admin-api-key: SGLang's control routes "
                                             "then accept only this key", metavar="KEY")


GROUPS = {"run": RunIdentity, "fleet": Fleet, "timeouts": Timeouts, "auth": Auth}
"""The groups of shared settings, by the attribute that holds each."""

_OPTION_HOLDERS = (*GROUPS, "options", "encoding_options")


@dataclass(kw_only=True, slots=True, init=False)
class PublisherConfig:
    """How and where to publish (see the module docstring): the groups, the chosen transport's and
    encoding's options, and the settings at the top. Every argument is a keyword; checked when built."""

    transport: str = option("broadcast", "how the buckets reach the servers, a registered transport "
                                         "(bridge.transports): broadcast (alias nccl), a custom process group, one "
                                         "broadcast per bucket; colocated, servers on this host, buckets handed over "
                                         "by reference; disk, HF snapshots announced in name resolution",
                            choices=transport_names)
    encoding: str = option("full", "how each sync's bytes are formed (bridge.encodings): full, every tensor; delta "
                                   "(broadcast, colocated), what changed since the version the servers serve, with a "
                                   "full sync (an anchor) when needed; fp8, every tensor, the projections as block "
                                   "FP8 (servers started with --quantization fp8; docs/fp8.md); fp8_delta (broadcast, colocated), the "
                                   "delta over the FP8 bytes and scales such servers serve",
                           choices=encoding_names)
    bucket_mb: float = option(help="byte budget of one bucket, in MiB; rank 0 holds at most about two buckets",
                              factory=_default_bucket_mb, metavar="MIB")
    serving_dtype: str = option("bfloat16", "dtype the servers serve; weights are cast to it on the way (fp32 "
                                            "master -> bf16)")
    backend: str | None = option(None, "nccl or gloo for the trainer's gathers and the weight-update group "
                                       "(default: nccl with CUDA, gloo without)", choices=("nccl", "gloo"))
    progress: bool = option(True, "show a progress bar for syncs that take longer than a second")
    metrics_port: int | None = option(None, "serve Prometheus metrics (sync seconds and bytes, failures, versions, "
                                            "servers excluded; bridge.metrics) at http://HOST:PORT/metrics from "
                                            "trainer rank 0 (default: off)", metavar="PORT")
    guard_every: float = option(2.0, "seconds between two probes of the fleet between publishes, from trainer rank 0 "
                                      "in the background, when servers are found in a router or a registry: a server "
                                      "that restarted or joined on weights behind the fleet's is taken out of rotation "
                                      "and paused at once (loaded from the newest snapshot where there is one), until "
                                      "the next publish repairs it and puts it back (docs/fleet.md); 0: off",
                                metavar="S")
    run: RunIdentity = option(help="which run this is", factory=RunIdentity)
    fleet: Fleet = option(help="the servers", factory=Fleet)
    timeouts: Timeouts = option(help="how long calls may take", factory=Timeouts)
    auth: Auth = option(help="the servers' keys", factory=Auth)
    options: Any = None
    """The transport's options (an instance of ``transport_class(transport).Options``); built from the
    flat keywords when not given."""
    encoding_options: Any = None
    """The encoding's options (an instance of ``encoding_class(encoding).Options``); built from the flat
    keywords when not given."""

    def __init__(self, *, options: Any = None, encoding_options: Any = None, **keywords: Any):
        for f in dataclasses.fields(PublisherConfig):
            if f.name in GROUPS:
                setattr(self, f.name, _group(f.name, keywords))
            elif f.name not in ("options", "encoding_options"):
                value = keywords.pop(f.name) if f.name in keywords else (
                    f.default if f.default is not dataclasses.MISSING else f.default_factory())
                setattr(self, f.name, value)
        cls = transport_class(self.transport)  # an unknown name is a ConfigError listing the known ones
        self.transport = cls.name  # aliases resolved
        enc = encoding_class(self.encoding)
        _refuse_foreign(cls, enc, keywords)
        self.options = _options(cls.Options, f"the {cls.name} transport", options, keywords)
        self.encoding_options = _options(enc.Options, f"the {enc.name} encoding", encoding_options, keywords)
        self._check()
        cls.check_config(self)
        enc.check_config(self, cls)

    @classmethod
    def keywords(cls, transport: str | None = None, encoding: str | None = None) -> set[str]:
        """The flat keywords the constructor takes for ``transport`` and ``encoding``: the shared settings, that
        transport's options and that encoding's; without one, every registered one's options."""
        names = {f.name for f in dataclasses.fields(cls)} - set(GROUPS)
        names |= {f.name for group in GROUPS.values() for f in dataclasses.fields(group)}
        t = [o.name for o in option_fields()] if transport is None else \
            [f.name for f in dataclasses.fields(transport_class(transport).Options)]
        e = [o.name for o in encoding_option_fields()] if encoding is None else \
            [f.name for f in dataclasses.fields(encoding_class(encoding).Options)]
        return names | set(t) | set(e)

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not attributes: a group's setting or an option, read flat.
        for holder in _OPTION_HOLDERS:
            try:
                obj = object.__getattribute__(self, holder)
            except AttributeError:  # not set yet (a failed __init__)
                continue
            if obj is not None and name in _names(type(obj)):
                return getattr(obj, name)
        raise AttributeError(f"PublisherConfig has no setting {name!r} (for the {_safe(self, 'transport')} transport "
                             f"and the {_safe(self, 'encoding')} encoding)")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)

    @property
    def session_options(self) -> SessionOptions | None:
        """The chosen transport's options when it updates servers in sessions (pause mode, load format, writer
        lease and lock: broadcast, colocated); None for one that does not (disk)."""
        return self.options if isinstance(self.options, SessionOptions) else None

    def _check(self) -> None:
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        dtype_from_str(self.serving_dtype)
        if self.metrics_port is not None:
            check_metrics_port(self.metrics_port)
        if isinstance(self.guard_every, bool) or not isinstance(self.guard_every, (int, float)) or \
                not 0 <= self.guard_every <= 3600:
            raise ConfigError(f"guard_every must be 0 (off) to 3600 seconds, got {self.guard_every!r}")
        if self.backend not in (None, "nccl", "gloo"):
            raise ConfigError(f"backend must be nccl or gloo (or None: nccl with CUDA, gloo without), got {self.backend!r}")


def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _safe(config: PublisherConfig, name: str) -> str:
    try:
        return object.__getattribute__(config, name)
    except AttributeError:
        return "?"


def _group(name: str, keywords: dict[str, Any]) -> Any:
    """The group ``name``: its object given as ``name=``, or built from its flat keywords (taken out of ``keywords``)."""
    cls = GROUPS[name]
    flat = {k: keywords.pop(k) for k in _names(cls) if k in keywords}
    given = keywords.pop(name, None)
    if given is None:
        return cls(**flat)
    if not isinstance(given, cls):
        raise ConfigError(f"{name}= must be a {cls.__name__}, got {type(given).__name__}")
    if flat:
        raise ConfigError(f"{sorted(flat)} given both as keywords and in {name}=; give each once")
    return given


def _refuse_foreign(cls, enc, keywords: dict[str, Any]) -> None:
    """A ConfigError for a keyword no one knows, or that is another transport's or encoding's option."""
    owners = {o.name: f"the {_and(o.owners)} transport{'s' if len(o.owners) > 1 else ''}" for o in option_fields()}
    owners |= {o.name: f"the {_and(o.owners)} encoding{'s' if len(o.owners) > 1 else ''}"
               for o in encoding_option_fields()}
    own = _names(cls.Options) | _names(enc.Options)
    unknown = sorted(set(keywords) - own - set(owners))
    if unknown:
        raise ConfigError(f"PublisherConfig got unknown keyword(s) {unknown}; known: {sorted(PublisherConfig.keywords())}")
    foreign = sorted(set(keywords) - own)
    if foreign:
        raise ConfigError("; ".join(f"{name} is an option of {owners[name]}, not of {_mine(name, cls, enc)}"
                                    for name in foreign)
                          + "".join(f" (the {o.name} {kind}'s options: {sorted(_names(o.Options)) or 'none'})"
                                    for o, kind in ((cls, "transport"), (enc, "encoding"))
                                    if any((_mine(n, cls, enc) == cls.name) == (kind == "transport") for n in foreign)))


def _mine(name: str, cls, enc) -> str:
    """``broadcast`` for a foreign transport option, ``the full encoding`` for a foreign encoding option."""
    return cls.name if name in {o.name for o in option_fields()} else f"the {enc.name} encoding"


def _options(options_cls: type, owner: str, given: Any, keywords: dict[str, Any]) -> Any:
    """The options object of ``owner`` (a transport or an encoding), ``given`` or built from its flat keywords."""
    own = {k: keywords[k] for k in _names(options_cls) if k in keywords}
    if given is None:
        return options_cls(**own)
    if not isinstance(given, options_cls):
        raise ConfigError(f"options for {owner} must be a {options_cls.__name__}, got {type(given).__name__}")
    if own:
        raise ConfigError(f"{sorted(own)} given both as keywords and in the options of {owner}; give each once")
    return given


def _and(names: tuple[str, ...]) -> str:
    """``disk``, ``broadcast and colocated``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def config_fields() -> list[OptionField]:
    """Every setting of a publisher as a command line shows it: the top settings, each group's, then every
    transport's options and every encoding's (their ``owners`` say whose)."""
    top = [f for f in fields_of(PublisherConfig) if f.name not in (*GROUPS, "options", "encoding_options")]
    groups = [f for g in GROUPS.values() for f in fields_of(g)]
    return [*top, *groups, *option_fields(), *encoding_option_fields()]


class _Described:
    """A default shown by its description (one computed when the config is built)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature() -> inspect.Signature:
    """The constructor as ``help()`` and editors should show it: each setting at the top, each group's settings
    (flat keywords), the groups, ``options`` and ``encoding_options``, then the chosen transport's and
    encoding's options as ``**transport_options``."""
    K = inspect.Parameter.KEYWORD_ONLY
    params = []
    for f in (*dataclasses.fields(PublisherConfig), *(f for g in GROUPS.values() for f in dataclasses.fields(g))):
        if f.name in GROUPS or f.name in ("options", "encoding_options"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else _Described(f.default_factory.__doc__)
        params.append(inspect.Parameter(f.name, K, default=default, annotation=f.type))
    for name, cls in GROUPS.items():
        params.append(inspect.Parameter(name, K, default=None, annotation=f"{cls.__name__} | None"))
    params.append(inspect.Parameter("options", K, default=None, annotation="Any"))
    params.append(inspect.Parameter("encoding_options", K, default=None, annotation="Any"))
    params.append(inspect.Parameter("transport_options", inspect.Parameter.VAR_KEYWORD, annotation="Any"))
    return inspect.Signature(params)


PublisherConfig.__signature__ = _signature()
PublisherConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *PublisherConfig.__signature__.parameters.values()])
