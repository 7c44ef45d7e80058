"""An adapter received over a weight-update group: the project route ``/wsync/load_lora_adapter_from_distributed``.

SGLang has no distributed route for adapters; the reference server takes one so that a trainer on another host
publishes an adapter without a shared disk (:class:`bridge.AdapterPublisher` ``via="broadcast"``). The trainer
(group rank 0) announces the adapter's tensors (``names``, ``dtypes``, ``shapes``: one flat buffer in
:class:`bridge.buckets.Bucket`'s layout) and broadcasts that buffer once; the server receives it as it receives a
flattened weight bucket (:func:`inference_adapter.wire.receive_tensors`: the byte-size check, the receive bounded
by ``--receive-timeout``), into a buffer of its own that the adapter's tensors stay views of.

What cannot be received (a group that does not exist, an announcement that does not describe a buffer, LoRA not
enabled) is refused before the receive, and the group is destroyed, as the bytes in flight would be read by the next
receive. A receive that fails (the trainer died or stalled) destroys the group too. Everything else is refused after
the receive, the group still usable. The served adapters change only once the adapter is built and checked
(:mod:`inference_adapter.routes.lora`): every refusal leaves the previous adapter serving.
"""

from __future__ import annotations

import torch

from bridge.buckets import Bucket
from bridge.errors import ConfigError
from inference_adapter.errors import RequestError
from inference_adapter.wire import ReceiveTimeout, SizeMismatch, WireError, receive_bound, receive_tensors, wire_specs

__all__ = ["receive_adapter"]


def receive_adapter(updates, adapters, *, lora_name: str, group_name: str, names: list[str], dtypes: list[str],
                    shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """The adapter's tensors off group ``group_name`` of ``updates`` (the server's
    :class:`~inference_adapter.weight_updates.WeightUpdates`: its lock and its groups), views of one received
    buffer; RequestError naming what was wrong and what became of the group."""
    action = f"Failed to load LoRA adapter {lora_name} from distributed"
    with updates.lock:  # one weight operation at a time; the groups change only under it
        groups = updates.groups
        pg = groups.pgs.get(group_name)
        if pg is None:
            raise groups.missing(group_name)
        try:
            adapters.require_enabled()
            specs = wire_specs(names, dtypes, shapes)
            if not specs:
                raise WireError("no tensors were announced")
            Bucket(specs)  # ConfigError: an offset the flat buffer cannot have
        except (RequestError, WireError, ConfigError) as e:
            groups.drop(group_name, "it was sent an adapter it could not receive")
            message = e.message if isinstance(e, RequestError) else f"{action}: {e}"
            raise RequestError(f"{message} The trainer's broadcast was not received, so group {group_name} was "
                               "destroyed; call init_weights_update_group again.") from None
        nbytes = sum(s.nbytes for s in specs)
        try:
            with groups.receiving_on(group_name):
                received = receive_tensors(
                    pg, specs, True, tag=f"{group_name}|{names}|{dtypes}|{shapes}", nccl=group_name in groups.nccl,
                    bound=lambda n: receive_bound(n, updates.receive_timeout, updates.group_timeout))
        except SizeMismatch as e:
            raise RequestError(f"{action}: {e}. The broadcast was received and discarded; the group is still "
                               "usable.") from None
        except Exception as e:  # any receive failure leaves the group unusable
            groups.drop(group_name, f"an adapter broadcast on it failed ({e})")
            why = "the trainer sent too little or stalled" if isinstance(e, ReceiveTimeout) else \
                f"the trainer may have died or timed out (group timeout {updates.group_timeout:g} s)"
            raise RequestError(f"{action}: the {nbytes}-byte broadcast on group {group_name} failed ({e}); {why}. "
                               "The group was destroyed; call init_weights_update_group again. The served adapter "
                               "is unchanged.") from None
    return dict(received)
