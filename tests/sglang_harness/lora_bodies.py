"""The client's LoRA request bodies through one SGLang release's own request structs and unpickler.

``python -m tests.sglang_harness.lora_bodies --sglang-dir DIR --bodies FILE``: FILE holds the JSON bodies
``{"from_tensors", "from_path", "unload"}`` as the client sends them. Each is validated by that release's own
struct (``LoadLoRAAdapterFromTensorsReqInput``, ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``) the
way FastAPI validates an ``Annotated[..., Body()]`` parameter (pydantic's ``TypeAdapter``); the tensors body's
payload is then opened as that release's worker opens it (0.5.20+: ``normalize_serialized_named_tensor_payloads``
and ``MultiprocessingSerializer.deserialize`` of rank 0's entry after ``monkey_patch_torch_reductions``, 0.5.23's
``SafeUnpickler`` allowlist included; 0.5.8: ``deserialize(serialized_tensors)``), and its ``config_dict`` parsed by
that release's ``LoRAConfig.from_dict``. Prints one JSON line: the name, the config dict and the sha256 of every
tensor (SGLang 0.5.23's ``expected_checksums`` digest: the bytes of the tensor in its dtype).
"""

from __future__ import annotations

import argparse
import hashlib
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang-dir", required=True)
    ap.add_argument("--bodies", required=True)
    args = ap.parse_args()
    from tests.sglang_harness.bootstrap import setup

    release = setup(args.sglang_dir)
    import torch
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import common

    with open(args.bodies) as f:
        bodies = json.load(f)
    TypeAdapter(io_struct.LoadLoRAAdapterReqInput).validate_python(bodies["from_path"])
    TypeAdapter(io_struct.UnloadLoRAAdapterReqInput).validate_python(bodies["unload"])
    req = TypeAdapter(io_struct.LoadLoRAAdapterFromTensorsReqInput).validate_python(bodies["from_tensors"])
    if release >= (0, 5, 20):
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        payloads = common.normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
        tensors = common.MultiprocessingSerializer.deserialize(payloads[0])
        if release >= (0, 5, 23):  # the allowlisted unpickler (CVE-2026-15969's fix) did the unpickling
            import inspect

            assert "SafeUnpickler(" in inspect.getsource(common.MultiprocessingSerializer.deserialize)
    else:
        tensors = common.MultiprocessingSerializer.deserialize(req.serialized_tensors)
    assert isinstance(tensors, dict), type(tensors)
    from sglang.srt.lora.lora_config import LoRAConfig

    cfg = (LoRAConfig.from_dict(req.config_dict, None, base_vocab_size=1000) if release >= (0, 5, 20)
           else LoRAConfig.from_dict(req.config_dict))
    sums = {n: hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}
    print(json.dumps({"lora_name": req.lora_name, "config_dict": req.config_dict, "checksums": sums, "r": cfg.r}))


if __name__ == "__main__":
    main()
