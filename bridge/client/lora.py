"""The LoRA adapter routes of :class:`bridge.client.ServerClient`, in the server's SGLang dialect (a mixin, like
:mod:`bridge.client.updates`).

* :meth:`LoraRoutes.load_adapter_from_path`: ``/load_lora_adapter`` (a PEFT adapter directory as the server sees it).
* :meth:`LoraRoutes.load_adapter_from_tensors`: ``/load_lora_adapter_from_tensors`` (SGLang >= 0.5.8), the body of
  the server's version: 0.5.20+ ``serialized_named_tensors`` (one base64 entry per TP rank, ``load_format``,
  ``expected_checksums``), 0.5.8-0.5.19 one string ``serialized_tensors``
  (:attr:`bridge.protocol.ProtocolFeatures.lora_tensors_per_rank`). Entries are SGLang's
  ``MultiprocessingSerializer`` output (:func:`serialize_adapter`): same-host tensors by reference, so this is a
  one-host path; across hosts an adapter goes by disk (or,
  to the reference server, by :meth:`LoraRoutes.load_adapter_from_distributed`).
* :meth:`LoraRoutes.load_adapter_from_distributed`: the reference server's ``/wsync/load_lora_adapter_from_distributed``
  (the tensors broadcast on a weight-update group, any host; SGLang has no such route).
* :meth:`LoraRoutes.unload_adapter`: ``/unload_lora_adapter``.
* :meth:`LoraRoutes.adapter_checksums`: the reference server's ``/wsync/lora_checksum``.

``version`` and ``replace`` go only to the reference server (``wsync_lora_version``, ``wsync_replace``): it then
reports the version on every generation with the adapter and replaces an adapter of that name atomically. Real
SGLang refuses a name that is loaded ("already loaded"), so ``replace=True`` there unloads the name, then loads
(:meth:`LoraRoutes._replace_on_sglang`). SGLang 0.5.23's unload waits for the generations that acquired the adapter
(they finish on it), and a generation asking for the name meanwhile makes SGLang reload it from the path of its
last load: by a stable path switched to the new adapter before the replace (what :class:`bridge.AdapterPublisher`
loads by disk), that generation is served the new adapter and the client's own load finds it loaded from its
path, the replace done; by tensors (path ``__tensor__``) that reload fails and the generation is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bridge.errors import ConfigError, ServerError
from bridge.log import get_logger
from bridge.protocol import ProtocolFeatures, wire_dtype

if TYPE_CHECKING:
    import torch

__all__ = ["LoraRoutes", "serialize_adapter", "tensors_body"]

logger = get_logger(__package__)

REPLACE_TRIES = 3
"""Unload-then-load rounds of a replace on real SGLang whose load found the name reloaded from another path."""


def serialize_adapter(tensors: Mapping[str, torch.Tensor]):
    """One TP rank's entry, as SGLang ``Engine``'s ``MultiprocessingSerializer.serialize(dict)`` writes it (base64 of
    torch's ``ForkingPickler``), and what it refers to: ``(entry, shared)``.

    The tensors are copied into a shared-memory file of this process's (:class:`bridge.transports.shared_tensors.
    SharedBuckets`) and pickled by its name, as torch's ``file_system`` strategy does, so the server on this host
    maps them: keep ``shared`` until the server answered, then ``shared.close()``. Only globals SGLang 0.5.23's
    ``SafeUnpickler`` allows (``tests/test_lora_server.py`` unpickles it with SGLang's own).
    """
    from bridge.transports.shared_tensors import SharedBuckets

    shared = SharedBuckets()
    try:
        return shared.share(dict(tensors)), shared
    except BaseException:
        shared.close()
        raise


def tensors_body(features: ProtocolFeatures, tp_size: int, name: str, config: Mapping[str, Any],
                 tensors: Mapping[str, torch.Tensor], *, pinned: bool = False,
                 checksums: Mapping[str, str] | None = None, url: str = "the server") -> tuple[dict, dict]:
    """The ``/load_lora_adapter_from_tensors`` body of SGLang ``features.version`` (without the project's fields),
    and the shared memory its entries refer to (close it once the server has answered: :func:`serialize_adapter`).

    Raises:
        ConfigError: that version has no such route (< 0.5.8), or cannot take it (0.5.8-0.5.19 with TP > 1).
    """
    f = features
    if not f.lora_from_tensors:
        raise ConfigError(f"{url} runs SGLang {f.version}, which has no /load_lora_adapter_from_tensors (needs "
                          ">= 0.5.8); load the adapter from a directory (load_adapter_from_path)")
    if not tensors:
        raise ConfigError("load_adapter_from_tensors needs the adapter's tensors; got none")
    entry, held = serialize_adapter({str(n): t.detach().contiguous() for n, t in tensors.items()})
    body: dict[str, Any] = {"lora_name": str(name), "config_dict": dict(config), "pinned": bool(pinned)}
    if f.lora_tensors_per_rank:
        body["serialized_named_tensors"] = [entry] * max(1, tp_size)
        if checksums is not None:
            body["expected_checksums"] = dict(checksums)
    else:
        if tp_size > 1:
            raise ConfigError(f"{url} runs SGLang {f.version} with TP {tp_size}: its single serialized_tensors "
                              "cannot serve several ranks; load the adapter from a directory")
        body["serialized_tensors"] = entry
    return body, held


class LoraRoutes:
    """LoRA adapter routes of one server (mixed into :class:`bridge.client.ServerClient`)."""

    def _lora_body(self, body: dict, version: str | None, replace: bool, rollback: bool = False) -> dict:
        """The project's fields, to the reference server only: the version, ``wsync_replace``, and the run and
        writer (:meth:`claim_run`, :meth:`name_writer`: the weights' version rule and one writer at a time);
        ``rollback``: this load goes back to an older version on purpose (``wsync_new_run`` for this request)."""
        if self.can.extensions:
            if version is not None:
                body["wsync_lora_version"] = str(version)
            body["wsync_replace"] = bool(replace)
            self._with_run(body)
            if rollback:
                body["wsync_new_run"] = True
        return body

    def _replace_on_sglang(self, route: str, body: dict, timeout: float | None) -> dict:
        """Real SGLang: unload the name (if loaded), then load. A load refused "already loaded" means a generation
        asked for the name in between and SGLang reloaded it from the path of its last load: when that is this
        body's path the adapter served is the one asked for (the caller switched that path to it first); else the
        name is unloaded and loaded again, :data:`REPLACE_TRIES` times at most."""
        name, path = body["lora_name"], body.get("lora_path")
        for _ in range(REPLACE_TRIES):
            self._unload_if_loaded(name)
            try:
                return self._http.call("POST", route, body, timeout=timeout)
            except ServerError as e:
                if "already loaded" not in str(e):
                    raise
            served = self._served_adapter_paths().get(name)
            if path is not None and served == path:
                logger.info("%s: a generation reloaded adapter %r from %s during its replace", self.url, name, path)
                return {"success": True, "error_message": "", "loaded_adapters": {name: path}}
        raise ServerError(self.url, f"adapter {name!r} was reloaded from another path ({served}) by generations "
                                    f"asking for it {REPLACE_TRIES} times during its replace; load it from a stable "
                                    "path (the path of its previous load, switched to the new adapter first)",
                          route=route)

    def _served_adapter_paths(self) -> dict:
        """``{name: path}`` of the adapters served, from ``/v1/models`` (SGLang lists each with ``root``: its path)."""
        out = self._http.call("GET", "/v1/models", None)
        return {m.get("id"): m.get("root") for m in out.get("data", []) if m.get("parent")}

    def _unload_if_loaded(self, name: str) -> None:
        try:
            self.unload_adapter(name)
        except ServerError as e:
            if "does not exist" not in str(e):
                raise

    def load_adapter_from_path(self, name: str, path: str, *, version: str | None = None, replace: bool = False,
                               pinned: bool = False, rollback: bool = False, timeout: float | None = None) -> dict:
        """``/load_lora_adapter``: the PEFT adapter directory ``path`` (as the server's host sees it) as ``name``.

        ``rollback``: put an older version back on purpose (a failed publish's undo); without it the reference
        server refuses a version older than the one it serves under that name (``VersionError``) unless the
        client claims a new run (:meth:`claim_run`).

        Returns SGLang's answer ``{"success", "error_message", "loaded_adapters"}``; a refusal raises
        ServerError with the server's words (LoRA disabled, already loaded, rank over ``--max-lora-rank``...).
        """
        body = self._lora_body({"lora_name": str(name), "lora_path": str(path), "pinned": bool(pinned)}, version,
                               replace, rollback)
        if replace and self.can.lora_replace != "one step":
            return self._replace_on_sglang("/load_lora_adapter", body, timeout)
        return self._http.call("POST", "/load_lora_adapter", body, timeout=timeout)

    def load_adapter_from_tensors(self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                                  *, version: str | None = None, replace: bool = False, pinned: bool = False,
                                  checksums: Mapping[str, str] | None = None, rollback: bool = False,
                                  timeout: float | None = None) -> dict:
        """``/load_lora_adapter_from_tensors``: ``tensors`` (PEFT's names, ``get_peft_model_state_dict``) with
        ``config`` (the adapter_config as a dict), in the body of the server's SGLang version; the tensors stay
        this process's until the answer (same host only).

        ``checksums`` (0.5.20+): ``{name: sha256}`` of each tensor's bytes (:func:`bridge.digest.tensor_checksum`),
        checked by the server before it loads anything. ``rollback``: as for :meth:`load_adapter_from_path`.

        Raises:
            ConfigError: the server's version has no such route (< 0.5.8), before anything is sent.
        """
        body, held = tensors_body(self.features, self.tp_size, name, config, tensors, pinned=pinned,
                                  checksums=checksums, url=self.url)
        body = self._lora_body(body, version, replace, rollback)
        answered = False
        try:
            if replace and self.can.lora_replace != "one step":
                out = self._replace_on_sglang("/load_lora_adapter_from_tensors", body, timeout)
            else:
                out = self._http.call("POST", "/load_lora_adapter_from_tensors", body, timeout=timeout)
            answered = True
        except ServerError as e:
            answered = e.status is not None
            raise
        finally:
            # Unanswered (a timeout, a lost connection): the server may still map the file, and an unpickling error
            # kills SGLang's scheduler; it is left to the sweep once this process is gone.
            if answered:
                held.close()
        return out

    def load_adapter_from_distributed(self, name: str, config: Mapping[str, Any], *, names: list[str], dtypes: list,
                                      shapes: list, group_name: str, version: str | None = None,
                                      replace: bool = False, pinned: bool = False,
                                      checksums: Mapping[str, str] | None = None, rollback: bool = False,
                                      timeout: float | None = None) -> dict:
        """Reference server only: ``/wsync/load_lora_adapter_from_distributed``: the server receives the adapter's
        tensors (``names``/``dtypes``/``shapes``, one flat buffer in :class:`bridge.buckets.Bucket`'s layout) from one
        broadcast on the weight-update group ``group_name``, which the caller (group rank 0) sends once this request
        is on its way; then checks ``checksums`` and loads it as :meth:`load_adapter_from_tensors` does.

        Raises:
            ConfigError: the server is not the reference server (SGLang has no distributed adapter route), before
                anything is sent.
        """
        if not self.can.lora_over_group:
            raise ConfigError(f"{self.url} is not the reference server (wsync serve): SGLang has no route that loads an "
                              "adapter over a weight-update group; publish it by disk (via='disk'), or by tensors "
                              "(via='tensors') from its host")
        body: dict[str, Any] = {
            "lora_name": str(name), "config_dict": dict(config), "names": [str(n) for n in names],
            "dtypes": [wire_dtype(d) for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes], "group_name": str(group_name), "pinned": bool(pinned)}
        if checksums is not None:
            body["expected_checksums"] = dict(checksums)
        body = self._lora_body(body, version, replace, rollback)
        return self._http.call("POST", "/wsync/load_lora_adapter_from_distributed", body, timeout=timeout)

    def unload_adapter(self, name: str, timeout: float | None = None) -> dict:
        """``/unload_lora_adapter``; ServerError (SGLang's "does not exist") if no adapter has that name."""
        body = self._with_run({"lora_name": str(name)})
        return self._http.call("POST", "/unload_lora_adapter", body, timeout=timeout)

    def adapter_checksums(self, name: str) -> dict:
        """Project extension, reference server only: ``/wsync/lora_checksum``: ``{"lora_name",
        "wsync_lora_version", "checksums": {tensor: sha256}, "dtypes"}`` of the adapter served as ``name``."""
        return self._http.call("POST", "/wsync/lora_checksum", {"lora_name": str(name)})
