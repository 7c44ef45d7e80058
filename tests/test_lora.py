"""LoRA (issue 37), the trainer side: a PEFT adapter trained on the FSDP2 engine and published alone.

One 2-rank gloo job trains the tiny preset's adapter (rank 4 on every projection) and returns what the
tests compare: the base weights before and after (unchanged), the adapter (changed), what the optimizer
holds, and the gathered adapter, which rank 0 loads into its own unsharded PEFT model as the oracle.
"""

from __future__ import annotations

import pytest
import torch

from bridge.errors import ConfigError
from tests.dist_utils import run_ranks
from tests.engine_bodies import unship

LORA = dict(rank=4, alpha=8.0)


def lora_engine(lr: float = 1e-2):
    from trainer import EngineConfig, FSDPEngine, LoraConfig, OptimizerConfig

    cfg = EngineConfig(preset="tiny", lora=LoraConfig(**LORA), optimizer=OptimizerConfig(lr=lr, weight_decay=0.0))
    return FSDPEngine(cfg).initialize()


def _train_body():
    from tests.engine_bodies import _ship
    from tests.sync_bodies import train_step

    engine = lora_engine()
    try:
        base0 = {s.name: t.clone() for s, t in engine.iter_full_tensors() if t is not None}
        adapter0 = engine.gather_adapter()
        adapter0 = {k: v.clone() for k, v in adapter0.items()} if adapter0 is not None else None
        for step in range(2):
            train_step(engine, seed=step)
        base1 = {s.name: t.clone() for s, t in engine.iter_full_tensors() if t is not None}
        adapter1 = engine.gather_adapter()
        in_optimizer = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
        batch = _probe_batch()
        logits = engine.forward(batch)
        out = dict(base0=base0, base1=base1, adapter0=adapter0, adapter1=adapter1, config=engine.adapter_config(),
                   specs=[(s.name, s.shape) for s in engine.adapter_specs()], param_names=[s.name for s in engine.param_specs()],
                   in_optimizer=in_optimizer, logits=logits)
        return _ship(out) if engine.rank == 0 else None
    finally:
        engine.destroy()


def _probe_batch():
    from tensordict import TensorDict

    ids = torch.tensor([[1] + [b + 3 for b in b"rev hello="]])
    return TensorDict(input_ids=ids, attention_mask=torch.ones_like(ids), batch_size=[1])


def peft_oracle(adapter: dict[str, torch.Tensor], config: dict, base: dict[str, torch.Tensor] | None = None):
    """The trainer's own model with the adapter, unsharded in this process: the tiny preset's base
    weights (or ``base``) wrapped by PEFT from ``config``, the adapter's tensors loaded by PEFT's own loader."""
    import peft

    from bridge.presets import build_model

    model = build_model("tiny", 0)
    if base is not None:
        model.load_state_dict(base, strict=False)
        model.tie_weights()
    pm = peft.get_peft_model(model, peft.LoraConfig.from_peft_type(**{k: v for k, v in config.items()
                                                                      if k not in ("peft_type", "inference_mode")}, peft_type="LORA"))
    result = peft.set_peft_model_state_dict(pm, adapter)
    assert not [k for k in result.unexpected_keys], result.unexpected_keys
    return pm.eval()


@pytest.fixture(scope="module")
def trained():
    rank0, rank1 = run_ranks(_train_body, 2, timeout=180)
    assert rank1 is None
    return unship([rank0])[0]


def test_lora_trains_only_the_adapter(trained):
    base0, base1 = trained["base0"], trained["base1"]
    assert list(base0) == trained["param_names"] and "model.layers.0.self_attn.q_proj.weight" in base0
    assert not any("lora" in n or "base_layer" in n for n in base0), "param_specs are the base model's HF names"
    assert all(torch.equal(base0[n], base1[n]) for n in base0), "a frozen base weight changed"
    a0, a1 = trained["adapter0"], trained["adapter1"]
    names = [n for n, _ in trained["specs"]]
    assert list(a1) == names and len(names) == 2 * 7 * 2  # A and B on 7 projections of 2 layers
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert all(not torch.any(a0[n]) for n in names if ".lora_B." in n), "PEFT starts lora_B at zero"
    changed = [n for n in names if ".lora_B." in n and not torch.equal(a0[n], a1[n])]
    assert len(changed) == 14, f"every lora_B should move in 2 steps, moved: {changed}"
    assert trained["in_optimizer"] == sum(t.numel() for t in a1.values()), "the optimizer holds exactly the adapter"
    assert trained["config"]["r"] == 4 and trained["config"]["lora_alpha"] == 8.0
    assert sorted(trained["config"]["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_gathered_adapter_is_the_trainers_model(trained):
    """The gathered adapter, loaded by PEFT on the base weights, computes the sharded engine's logits."""
    pm = peft_oracle(trained["adapter1"], trained["config"], trained["base1"])
    with torch.no_grad():
        batch = _probe_batch()
        logits = pm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, trained["logits"], rtol=1e-5, atol=1e-5)


def test_lora_config_refusals():
    from trainer import EngineConfig, LoraConfig

    with pytest.raises(ConfigError, match="lora.rank must be an integer >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="lora.alpha"):
        LoraConfig(alpha=float("nan"))
    with pytest.raises(ConfigError, match="lora.target_modules must name"):
        LoraConfig(target_modules=())
    with pytest.raises(ConfigError, match="lora must be a LoraConfig"):
        EngineConfig(preset="tiny", lora={"rank": 4})
    assert LoraConfig(target_modules="q_proj,v_proj").target_modules == ("q_proj", "v_proj")
