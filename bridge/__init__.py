"""wsync's public Python API: versioned weight publishing from a trainer into SGLang servers.

Trainer side (every rank calls ``publish`` with the same version after a step)::

    from bridge import PublisherConfig, WeightPublisher

    pub = WeightPublisher(PublisherConfig(transport="broadcast", servers=["http://127.0.0.1:30000"]))
    result = pub.publish(model_or_engine, version=step)   # collective across trainer ranks
    print(result.version, result.seconds, result.gbps, result.servers)

or, through disk snapshots announced in name resolution::

    pub = WeightPublisher(PublisherConfig(transport="disk", name_resolve="etcd://127.0.0.1:2379",
                                          experiment="exp", trial="t0", snapshot_root="/shared/ckpt"))

A LoRA adapter alone (``EngineConfig(lora=...)`` on the trainer; docs/lora.md), by disk or, on one host, by tensors::

    pub = AdapterPublisher(AdapterPublisherConfig(name="policy", via="disk", servers=["http://127.0.0.1:30000"]))
    result = pub.publish(engine, version=step)            # collective; servers serve it as lora_path="policy"

Serving side: :class:`ServerGroup` asks which version each server serves (``weight_versions()``);
:class:`VersionSubscriber` yields each announced version; ``inference_adapter.DiskWatcher`` applies them.

Versions are integers, strictly increasing per publisher and per (experiment, trial); an older version,
or the same version with other weights, is refused with :class:`VersionError`; retrying a version
with the same weights is safe.
"""

from __future__ import annotations

import importlib

# name -> module; imported on first use so ``import bridge`` stays light (no etcd, no HTTP stack).
_EXPORTS = {
    "Announcement": "bridge.name_resolve",
    "AdapterPublishResult": "bridge.lora.publisher",
    "AdapterPublisher": "bridge.lora.publisher",
    "AdapterPublisherConfig": "bridge.lora.publisher",
    "BridgeError": "bridge.errors",
    "Bucket": "bridge.buckets",
    "ConfigError": "bridge.errors",
    "NameResolveError": "bridge.errors",
    "ParamSpec": "bridge.tensors",
    "PublishResult": "bridge.publisher.core",
    "PublisherConfig": "bridge.publisher.core",
    "ServerClient": "bridge.client",
    "ServerError": "bridge.errors",
    "ServerGroup": "bridge.client",
    "SnapshotError": "bridge.errors",
    "SyncError": "bridge.errors",
    "SyncTimeout": "bridge.errors",
    "VersionError": "bridge.errors",
    "VersionSubscriber": "bridge.serving.subscriber",
    "WeightPublisher": "bridge.publisher.core",
    "make_name_resolve": "bridge.name_resolve",
    "plan_buckets": "bridge.buckets",
    "read_snapshot": "bridge.snapshot",
    "write_snapshot": "bridge.snapshot",
}

__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` for ``package`` that imports each name of ``exports`` (name -> module) on first use."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name in exports:
            value = namespace[name] = getattr(importlib.import_module(exports[name]), name)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
