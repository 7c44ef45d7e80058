"""Per-rank bodies of the FSDP2 engine tests (spawned ranks need importable top-level functions).

Each body runs on every rank of a 2-rank gloo job (tests.dist_utils.run_ranks) and returns what the
test compares against its single-process oracle; only rank 0's full tensors are returned.
"""

from __future__ import annotations

import copy
import io
import math

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from bridge.errors import ConfigError

VOCAB = 272  # bridge.local.presets.VOCAB_SIZE
# eps is large on purpose: k_proj.bias has an analytically zero gradient (softmax ignores a shift shared
# by all keys), so its gradient is rounding noise, which Adam divides by ~eps. With eps=1e-8 that noise
# alone moves the bias by ~lr/100, and differently in the sharded and the unsharded run.
OPTIM = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, warmup_steps=2, schedule="cosine",
             total_steps=6, min_lr_ratio=0.1, max_grad_norm=0.5)


def _ship(out: dict) -> bytes:
    # Tensors put on a multiprocessing queue travel as shared-memory handles that die with the rank's
    # process, which may exit before the parent reads them: send plain bytes instead.
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def unship(results: list[bytes]) -> list[dict]:
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def make_batch(seed: int, n_rows: int = 8, width: int = 24) -> TensorDict:
    """A right-padded batch: the first half long sequences, the second half short ones, with a loss mask
    that hides a random prompt. Rank r trains on rows [r * n/2, (r + 1) * n/2)."""
    g = torch.Generator().manual_seed(seed)
    half = n_rows // 2
    long = torch.randint(14, width + 1, (half,), generator=g)
    short = torch.randint(2, 9, (n_rows - half,), generator=g)
    lengths = torch.cat([long, short])
    cols = torch.arange(width)
    attention_mask = (cols < lengths[:, None]).long()
    input_ids = torch.randint(3, VOCAB, (n_rows, width), generator=g) * attention_mask
    prompt = torch.randint(0, 4, (n_rows, 1), generator=g)
    loss_mask = attention_mask * (cols >= prompt).long()
    return TensorDict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, batch_size=[n_rows])


def rank_half(batch: TensorDict, rank: int, world_size: int) -> TensorDict:
    n = batch.batch_size[0] // world_size
    return batch[rank * n : (rank + 1) * n]


def _full_state(engine, specs=None) -> dict[str, torch.Tensor] | None:
    out = {}
    for spec, tensor in engine.iter_full_tensors(specs):
        if tensor is not None:
            out[spec.name] = tensor.clone()
    return out if engine.rank == 0 else None


def _full_optim(engine) -> dict | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_optimizer_state_dict(engine.model, engine.optimizer, options=options)
    # Non-DTensor entries (AdamW's "step") come back as the live tensors: copy them for a snapshot.
    return copy.deepcopy(sd) if engine.rank == 0 else None


def _snapshot(engine) -> dict:
    """Everything a step may change: full params and optimizer state (rank 0), schedule and step count."""
    return {"params": _full_state(engine), "optim": _full_optim(engine), "epoch": engine.lr_scheduler.last_epoch,
            "step": engine.global_step, "lr": engine.lr_scheduler.get_last_lr()[0]}


def _expect_config_error(fn, match: str) -> str:
    try:
        fn()
    except ConfigError as e:
        assert match in str(e), f"expected {match!r} in {e}"
        return str(e)
    raise AssertionError(f"no ConfigError (expected {match!r})")


def train_body(model_dir: str, n_steps: int) -> dict:
    """An engine from an HF directory: weights and logits at init, then n_steps of training."""
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig
    from trainer.data import pack_micro_batches

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = FSDPEngine(EngineConfig(model_path=model_dir, mb_max_tokens=40, optimizer=OptimizerConfig(**OPTIM)))
    engine.initialize()
    out: dict = {"tied": engine.tie_word_embeddings, "version": engine.version, "device": str(engine.device)}
    out["specs"] = [(s.name, s.shape, s.dtype) for s in engine.param_specs()]
    out["init"] = _full_state(engine)
    first = rank_half(make_batch(0), rank, world)
    out["logits"] = engine.forward(first)
    out["eval_loss"] = engine.eval_batch(first)
    # FSDP2 leaves the root unit unsharded after a forward without backward; the engine reshards it.
    assert all(isinstance(p, DTensor) for p in engine.model.parameters())
    assert [(s.name, s.shape, s.dtype) for s in engine.param_specs()] == out["specs"]
    out["local_mbs"] = []
    out["stats"] = []
    for step in range(n_steps):
        batch = rank_half(make_batch(step), rank, world)
        out["local_mbs"].append(len(pack_micro_batches(batch, 40)))
        out["stats"].append(engine.train_batch(batch))
    out["final"] = _full_state(engine)
    out["scheduler_epoch"] = engine.lr_scheduler.last_epoch
    engine.destroy()
    return _ship(out)


def checkpoint_body(tmp: str) -> dict:
    """Save/load round trips (hf, dcp), skipped non-finite steps, bad inputs and a mixed-precision engine."""
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig, next_token_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = dict(preset="tiny", mb_max_tokens=64, optimizer=OptimizerConfig(**OPTIM))
    batches = [rank_half(make_batch(10 + i), rank, world) for i in range(4)]
    out: dict = {}

    a = FSDPEngine(EngineConfig(**cfg, seed=0)).initialize()
    for b in batches[:2]:
        assert a.train_batch(b)["update_successful"]
    saved = _snapshot(a)
    a.save(f"{tmp}/hf", weight_format="hf", with_optim=True)
    a.save(f"{tmp}/dcp", weight_format="dcp", with_optim=True)
    a.train_batch(batches[2])
    reference = _full_state(a)

    out["loaded"] = {}
    for i, fmt in enumerate(("hf", "dcp")):
        b = FSDPEngine(EngineConfig(**cfg, seed=1 + i)).initialize()  # other initial weights
        b.load(f"{tmp}/{fmt}", weight_format=fmt, with_optim=True)
        got = _snapshot(b)
        b.train_batch(batches[2])
        got["next"] = _full_state(b)
        out["loaded"][fmt] = got
        b.destroy()
    out["saved"], out["reference"] = saved, reference
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(f"{tmp}/hf")
        out["hf_from_pretrained"] = {k: v.clone() for k, v in hf.state_dict().items()}

    # Bad paths and formats fail on every rank, and nothing hangs.
    out["errors"] = [
        _expect_config_error(lambda: a.load(f"{tmp}/missing", weight_format="hf"), "does not exist"),
        _expect_config_error(lambda: a.load(f"{tmp}/missing", weight_format="dcp"), "does not exist"),
        _expect_config_error(lambda: a.save(f"{tmp}/x", weight_format="pickle"), "unknown weight_format"),
    ]

    # Non-finite gradients: no step, nothing changes. "nan" hits rank 1 only; the norm is global.
    before = _snapshot(a)
    skipped = []
    inf_loss = lambda logits, mb: next_token_loss(logits, mb) * float("inf")  # noqa: E731
    nan_on_1 = lambda logits, mb: next_token_loss(logits, mb) * (float("nan") if rank == 1 else 1.0)  # noqa: E731
    for loss_fn in (inf_loss, nan_on_1):
        skipped.append(a.train_batch(batches[3], loss_fn=loss_fn))
    after = _snapshot(a)
    out["nonfinite"] = {"before": before, "after": after, "stats": skipped}

    # A bad batch on one rank raises ConfigError on both (the other rank names it), then training goes on.
    good = batches[3]
    nothing = torch.zeros(0, 5, dtype=torch.long)
    empty = TensorDict(input_ids=nothing, attention_mask=nothing, batch_size=[0])
    no_mask = TensorDict(input_ids=good["input_ids"], batch_size=good.batch_size)
    no_ids = TensorDict(attention_mask=good["attention_mask"], batch_size=good.batch_size)
    out["batch_errors"] = [
        _expect_config_error(lambda: a.train_batch(empty if rank == 1 else good), ("rank(s) [1]", "empty batch")[rank]),
        _expect_config_error(lambda: a.train_batch(no_mask if rank == 0 else good),
                             ("attention_mask", "rank(s) [0]")[rank]),
        _expect_config_error(lambda: a.eval_batch(no_ids), "input_ids"),
    ]
    resumed = a.train_batch(good)
    out["resumed"] = {"stats": resumed, "epoch": a.lr_scheduler.last_epoch, "step": a.global_step}
    a.destroy()

    # Mixed precision + CPU offload: trains, and a bfloat16 sync gathers the cast tensors.
    c = FSDPEngine(EngineConfig(**cfg, param_dtype="bfloat16", cpu_offload=True)).initialize()
    out["bf16_stats"] = c.train_batch(batches[0])
    full32 = _full_state(c)
    full16 = _full_state(c, [s.with_dtype(torch.bfloat16) for s in c.param_specs()])
    if rank == 0:
        out["bf16_sync_ok"] = all(torch.equal(full16[k], v.to(torch.bfloat16)) for k, v in full32.items())
        out["bf16_dtypes"] = {v.dtype for v in full16.values()}
    c.destroy()
    return _ship(out)


def lr_at(step: int) -> float:
    """The schedule of OPTIM written out independently: linear warmup to lr, then cosine to 10 %."""
    o = OPTIM
    if step < o["warmup_steps"]:
        return o["lr"] * (step + 1) / o["warmup_steps"]
    p = min(1.0, (step - o["warmup_steps"]) / (o["total_steps"] - o["warmup_steps"]))
    return o["lr"] * (o["min_lr_ratio"] + (1 - o["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * p)))
