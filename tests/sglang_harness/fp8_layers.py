"""What the ``fp8`` encoding sends for a quantized layer, checked by SGLang's own block-FP8 code, on CPU.

``python -m tests.sglang_harness.fp8_layers --sglang-dir DIR --model MODEL_DIR --payload FILE``: ``FILE`` (``torch.save``)
holds ``{"quantization_config": ..., "tensors": {HF name: tensor}}``, the tensors of layer 0 as the publisher's
fp8 encoding sent them. Builds SGLang's own ``Qwen2MLP`` and ``Qwen2Attention`` projections for layer 0 of the
model's config with SGLang's ``Fp8Config.from_config(quantization_config)`` (so ``Fp8LinearMethod.create_weights``
registers their parameters: ``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear`` on one TP
rank), loads the payload through SGLang's own ``load_weights`` (the stacked q/k/v and gate/up dispatch and each
parameter's ``weight_loader``), and prints one JSON line ``FP8_LAYERS {...}``: every registered parameter's name,
dtype and shape, and its sha256 after loading. STUB: what :mod:`tests.sglang_harness.serve` stubs (imports, the
runtime context and a TP group of one); nothing of the FP8 path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sglang-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--payload", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.sglang_harness.bootstrap import setup

    rel = setup(args.sglang_dir)
    import torch
    import torch.distributed as dist
    import transformers

    from bridge.process_group import find_free_port
    from tests.sglang_harness.serve import Harness, _parse

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    h = object.__new__(Harness)
    h.args = _parse(["--sglang-dir", args.sglang_dir, "--model", args.model, "--port", "0"])  # the server's defaults
    h.rel = rel
    h._build_runtime()
    h._sglang_tp_group()
    import sglang.srt.models.qwen2 as qwen2
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    payload = torch.load(args.payload)
    quant = Fp8Config.from_config(payload["quantization_config"])
    cfg = transformers.AutoConfig.from_pretrained(args.model)
    torch.set_default_dtype(torch.bfloat16)
    mlp = qwen2.Qwen2MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, quant_config=quant,
                         prefix="model.layers.0.mlp")
    # STUB: Qwen2Attention's __init__ (its rotary embedding needs vllm's kernels); its projections are SGLang's own,
    # built as that __init__ builds them, and its own load_weights runs.
    from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear

    attn = object.__new__(qwen2.Qwen2Attention)
    torch.nn.Module.__init__(attn)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      bias=True, quant_config=quant, prefix="model.layers.0.self_attn.qkv_proj")
    attn.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size, bias=False, quant_config=quant,
                                    prefix="model.layers.0.self_attn.o_proj")
    methods = sorted({type(m.quant_method).__name__ for m in (*mlp.modules(), *attn.modules())
                      if getattr(m, "quant_method", None) is not None})
    registered = {}
    for prefix, mod in (("mlp.", mlp), ("self_attn.", attn)):
        for n, t in mod.named_parameters():
            registered[prefix + n] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    loaded = set()
    with torch.no_grad():
        for prefix, mod in (("mlp.", mlp), ("self_attn.", attn)):
            full = "model.layers.0." + prefix
            mine = [(n.removeprefix(full), t) for n, t in payload["tensors"].items() if n.startswith(full)]
            loaded |= {prefix + n for n in mod.load_weights(mine)}
    after = {prefix + n: _sha(t) for prefix, mod in (("mlp.", mlp), ("self_attn.", attn)) for n, t in mod.named_parameters()}
    print("FP8_LAYERS " + json.dumps({"registered": registered, "loaded": sorted(loaded), "sha": after,
                                      "methods": methods, "fp8_method": Fp8LinearMethod.__name__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
