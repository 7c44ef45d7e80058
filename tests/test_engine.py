"""The FSDP2 engine against an oracle: one unsharded process training the same model on the whole batch.

Two spawned 2-rank gloo jobs do all the multi-process work (module fixtures); the tests read their
results. Argument and config checks run in this process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from bridge.errors import ConfigError
from tests.dist_utils import run_ranks
from tests.engine_bodies import OPTIM, checkpoint_body, lr_at, make_batch, train_body, unship

N_STEPS = 3


# ---------------------------------------------------------------------------------------------- oracle


def _oracle_loss(logits: torch.Tensor, batch: TensorDict) -> torch.Tensor:
    """Mean cross entropy of token t+1 over the tokens both masks keep, over the whole batch."""
    keep = (batch["attention_mask"] * batch["loss_mask"])[:, 1:].bool()
    targets = batch["input_ids"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return ce.view_as(targets)[keep].mean()


def _oracle(model_dir: str, n_steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    first = make_batch(0)
    with torch.no_grad():
        logits = model(input_ids=first["input_ids"], attention_mask=first["attention_mask"]).logits
        eval_loss = float(_oracle_loss(logits, first))
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                            weight_decay=OPTIM["weight_decay"])
    losses, norms = [], []
    for step in range(n_steps):
        batch = make_batch(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = _oracle_loss(out, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(init=init, logits=logits, eval_loss=eval_loss, losses=losses, norms=norms, final=model.state_dict())


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    return unship(run_ranks(train_body, world_size=2, args=(tiny_model_dir, N_STEPS))), _oracle(tiny_model_dir, N_STEPS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return unship(run_ranks(checkpoint_body, world_size=2, args=(str(tmp_path_factory.mktemp("ckpt")),)))


# ---------------------------------------------------------------------------------------------- training


def test_training_matches_unsharded_oracle(trained):
    (r0, r1), oracle = trained
    # Rank 0 holds the long sequences, rank 1 the short ones: rank 1 runs zero-weight dummy passes.
    assert any(a != b for a, b in zip(r0["local_mbs"], r1["local_mbs"]))
    for step in range(N_STEPS):
        s0, s1 = r0["stats"][step], r1["stats"][step]
        assert s0["update_successful"] and s1["update_successful"]
        assert s0["n_microbatches"] == s1["n_microbatches"] == max(r0["local_mbs"][step], r1["local_mbs"][step])
        assert s0["loss"] == s1["loss"] and s0["grad_norm"] == s1["grad_norm"]
        assert math.isclose(s0["loss"], oracle["losses"][step], rel_tol=1e-5)
        assert math.isclose(s0["grad_norm"], oracle["norms"][step], rel_tol=1e-4)
        assert s0["n_tokens"] == int(make_batch(step)["attention_mask"].sum())
    assert oracle["norms"][0] > OPTIM["max_grad_norm"]  # clipping was exercised
    final = r0["final"]
    assert set(final) == set(oracle["final"]) - {"lm_head.weight"}
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, oracle["final"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert r1["final"] is None


def test_forward_and_eval_match_oracle(trained):
    (r0, r1), oracle = trained
    mask = make_batch(0)["attention_mask"].bool()
    logits = torch.cat([r0["logits"], r1["logits"]])
    torch.testing.assert_close(logits[mask], oracle["logits"][mask], rtol=1e-4, atol=1e-5)
    assert torch.all(logits[~mask] == 0)
    assert r0["eval_loss"] == r1["eval_loss"]
    assert math.isclose(r0["eval_loss"], oracle["eval_loss"], rel_tol=1e-5)


def test_lr_schedule_steps_once_per_train_batch(trained):
    (r0, _), _ = trained
    assert [s["lr"] for s in r0["stats"]] == pytest.approx([lr_at(k) for k in range(N_STEPS)], rel=1e-12)
    assert r0["scheduler_epoch"] == N_STEPS


def test_full_tensors_and_specs_match_unsharded_model(trained):
    (r0, r1), oracle = trained
    assert r0["tied"] and r0["version"] == 0 and r0["device"] == "cpu"
    names = [n for n, _, _ in r0["specs"]]
    # HF state-dict names of the unwrapped model, in its order, lm_head.weight left out (tied).
    assert names == [n for n in oracle["init"] if n != "lm_head.weight"]
    assert r1["specs"] == r0["specs"]
    for name, shape, dtype in r0["specs"]:
        assert shape == tuple(oracle["init"][name].shape) and dtype == oracle["init"][name].dtype
    assert list(r0["init"]) == names
    for name, tensor in r0["init"].items():
        assert torch.equal(tensor, oracle["init"][name]), name
    assert r1["init"] is None


# ---------------------------------------------------------------------------------------------- checkpoints


def _assert_optim_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for name, state in a["state"].items():
        assert state.keys() == b["state"][name].keys()
        for key, value in state.items():
            assert torch.equal(value, b["state"][name][key]), (name, key)


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_save_load_round_trips_bit_exactly(checkpoints, fmt):
    r0, _ = checkpoints
    saved, got = r0["saved"], r0["loaded"][fmt]
    for name, tensor in saved["params"].items():
        assert torch.equal(got["params"][name], tensor), name
    _assert_optim_equal(saved["optim"], got["optim"])
    assert (got["epoch"], got["step"]) == (saved["epoch"], saved["step"]) == (2, 2)
    # One more step after the load gives exactly what the run that never stopped got.
    for name, tensor in r0["reference"].items():
        assert torch.equal(got["next"][name], tensor), name


def test_hf_checkpoint_is_a_plain_hf_model(checkpoints):
    r0, _ = checkpoints
    hf = r0["hf_from_pretrained"]
    for name, tensor in r0["saved"]["params"].items():
        assert torch.equal(hf[name], tensor), name
    assert torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])


def test_checkpoint_errors_reach_every_rank(checkpoints):
    for r in checkpoints:
        assert len(r["errors"]) == 3


def test_nonfinite_grads_skip_the_step(checkpoints):
    r0, r1 = checkpoints
    nf = r0["nonfinite"]
    for stats in nf["stats"] + r1["nonfinite"]["stats"]:
        assert stats["update_successful"] is False and not math.isfinite(stats["grad_norm"])
    before, after = nf["before"], nf["after"]
    for name, tensor in before["params"].items():
        assert torch.equal(after["params"][name], tensor), name
    _assert_optim_equal(before["optim"], after["optim"])
    assert (after["epoch"], after["step"], after["lr"]) == (before["epoch"], before["step"], before["lr"])
    # The next good step runs, and the schedule moves by exactly one.
    resumed = r0["resumed"]
    assert resumed["stats"]["update_successful"] and resumed["stats"]["lr"] == pytest.approx(lr_at(before["step"]))
    assert (resumed["epoch"], resumed["step"]) == (before["epoch"] + 1, before["step"] + 1)


def test_bad_batch_on_one_rank_fails_on_all(checkpoints):
    r0, r1 = checkpoints
    assert "rank(s) [1]" in r0["batch_errors"][0] and "empty batch" in r1["batch_errors"][0]
    assert "attention_mask" in r0["batch_errors"][1] and "rank(s) [0]" in r1["batch_errors"][1]


def test_mixed_precision_cpu_offload_trains_and_syncs_bf16(checkpoints):
    r0, r1 = checkpoints
    assert r0["bf16_stats"]["update_successful"] and r1["bf16_stats"]["update_successful"]
    assert r0["bf16_sync_ok"] and r0["bf16_dtypes"] == {torch.bfloat16}


# ---------------------------------------------------------------------------------------------- in-process


def test_model_dir_errors(tmp_path):
    from transformers import BertConfig, T5Config

    from bridge.local.presets import build_tokenizer
    from trainer import EngineConfig, FSDPEngine

    def init(path):
        FSDPEngine(EngineConfig(model_path=str(path))).initialize()

    with pytest.raises(ConfigError, match="does not exist"):
        init(tmp_path / "nope")
    tok_only = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_only)
    with pytest.raises(ConfigError, match="no config.json"):
        init(tok_only)
    bert = tmp_path / "bert"
    BertConfig(architectures=["BertForMaskedLM"]).save_pretrained(bert)
    with pytest.raises(ConfigError, match="not a causal language model"):
        init(bert)
    t5 = tmp_path / "t5"
    T5Config().save_pretrained(t5)
    with pytest.raises(ConfigError, match="'t5' model"):
        init(t5)
    bad_json = tmp_path / "bad"
    bad_json.mkdir()
    (bad_json / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ConfigError, match="not a transformers config"):
        init(bad_json)


def test_config_errors():
    from trainer import EngineConfig, OptimizerConfig

    with pytest.raises(ConfigError, match="exactly one"):
        EngineConfig()
    with pytest.raises(ConfigError, match="exactly one"):
        EngineConfig(preset="tiny", model_path="/x")
    with pytest.raises(ConfigError, match="unknown preset"):
        EngineConfig(preset="huge")
    with pytest.raises(ConfigError, match="total_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="schedule"):
        OptimizerConfig(schedule="step")
    with pytest.raises(ConfigError, match="param_dtype"):
        EngineConfig(preset="tiny", param_dtype="int8")
    with pytest.raises(ConfigError, match="mb_max_tokens"):
        EngineConfig(preset="tiny", mb_max_tokens=0)


def test_batch_validation_names_the_key():
    from trainer.data import validate_batch

    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="empty batch"):
        validate_batch(TensorDict(input_ids=ids[:0], attention_mask=ids[:0], batch_size=[0]))
    with pytest.raises(ConfigError, match="empty batch"):
        validate_batch(TensorDict(input_ids=ids, attention_mask=ids * 0, batch_size=[2]))
    with pytest.raises(ConfigError, match="'input_ids'"):
        validate_batch(TensorDict(attention_mask=ids, batch_size=[2]))
    with pytest.raises(ConfigError, match="'attention_mask'"):
        validate_batch(TensorDict(input_ids=ids, batch_size=[2]))
    with pytest.raises(ConfigError, match="loss_mask has shape"):
        validate_batch(TensorDict(input_ids=ids, attention_mask=ids, loss_mask=ids[:, :3], batch_size=[2]))
    validate_batch({"input_ids": ids, "attention_mask": ids})  # a plain mapping is a batch too
    with pytest.raises(ConfigError, match="rows of input_ids"):
        validate_batch({"input_ids": ids, "attention_mask": ids[:1]})


def test_packing_keeps_every_token_within_budget():
    from trainer.data import pack_micro_batches

    g = torch.Generator().manual_seed(0)
    n, width, budget = 12, 16, 30
    lengths = torch.randint(0, width + 1, (n,), generator=g)
    lengths[3] = width  # longer than budget / 2: alone in its micro-batch
    left = torch.rand(n, generator=g) < 0.5  # padding on either side
    cols = torch.arange(width)
    mask = torch.where(left[:, None], cols >= width - lengths[:, None], cols < lengths[:, None]).long()
    ids = torch.randint(3, 100, (n, width), generator=g) * mask
    score = torch.randn(n, width, 2, generator=g)  # a per-token extra key, carried along
    batch = TensorDict(input_ids=ids, attention_mask=mask, score=score, reward=torch.arange(n), batch_size=[n])
    mbs = pack_micro_batches(batch, budget)
    seen = set()
    for mb in mbs:
        b, length = mb.data["input_ids"].shape
        assert b * length <= budget or b == 1
        assert length == int(mb.data["attention_mask"].sum(1).max())
        for j, row in enumerate(mb.rows.tolist()):
            real = mask[row].bool()
            k = int(real.sum())
            assert mb.data["attention_mask"][j].tolist() == [1] * k + [0] * (length - k)  # right-padded
            assert torch.equal(mb.data["input_ids"][j, :k], ids[row][real])
            assert torch.equal(mb.data["score"][j, :k], score[row][real])
            assert int(mb.data["reward"][j]) == row
            seen.add(row)
    assert seen == {r for r in range(n) if lengths[r] > 0}


def test_lr_factor_formula():
    from trainer.config import OptimizerConfig
    from trainer.optim import lr_factor

    for schedule in ("constant", "linear", "cosine"):
        cfg = OptimizerConfig(lr=1.0, warmup_steps=3, schedule=schedule, total_steps=10, min_lr_ratio=0.2)
        for s in range(14):
            p = min(1.0, max(0.0, (s - 3) / 7))
            decay = {
                "constant": 1.0,
                "linear": 0.2 + 0.8 * (1 - p),
                "cosine": 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p)),
            }
            expected = (s + 1) / 3 if s < 3 else decay[schedule]
            assert lr_factor(cfg, s) == pytest.approx(expected, rel=1e-12), (schedule, s)
