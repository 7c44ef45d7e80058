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
    "AdapterPublishResult": "bridge.adapters",
    "AdapterPublisher": "bridge.adapters",
    "AdapterPublisherConfig": "bridge.adapters",
    "BridgeError": "bridge.errors",
    "Bucket": "bridge.buckets",
    "ConfigError": "bridge.errors",
    "NameResolveError": "bridge.errors",
    "ParamSpec": "bridge.tensors",
    "PublishResult": "bridge.publisher",
    "PublisherConfig": "bridge.publisher",
    "ServerClient": "bridge.client",
    "ServerError": "bridge.errors",
    "ServerGroup": "bridge.client",
    "SnapshotError": "bridge.errors",
    "SyncError": "bridge.errors",
    "SyncTimeout": "bridge.errors",
    "VersionError": "bridge.errors",
    "VersionSubscriber": "bridge.subscriber",
    "WeightPublisher": "bridge.publisher",
    "make_name_resolve": "bridge.name_resolve",
    "plan_buckets": "bridge.buckets",
    "read_snapshot": "bridge.snapshot",
    "write_snapshot": "bridge.snapshot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
