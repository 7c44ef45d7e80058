"""Per-rank bodies shared by the end-to-end sync tests (importable, so spawned ranks can run them)."""

from __future__ import annotations


def engine(preset: str = "tiny"):
    from trainer import EngineConfig, FSDPEngine, OptimizerConfig

    e = FSDPEngine(EngineConfig(preset=preset, optimizer=OptimizerConfig(lr=3e-3)))
    e.initialize()
    return e


def check_served(engine, urls: list[str], version: int) -> dict:
    """Rank 0: compare every served tensor, the version and a greedy answer with the trainer's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridge.client import ServerClient
    from bridge.protocol import tensor_checksum

    full = {s.name: t for s, t in engine.iter_full_tensors()}  # collective
    if engine.rank != 0:
        return {}
    want = {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in full.items()}
    local = AutoModelForCausalLM.from_config(engine.model_config, dtype=torch.bfloat16).eval()
    local.load_state_dict({n: t.to(torch.bfloat16) for n, t in full.items()}, strict=False)
    local.tie_weights()
    prompt = [1] + [b + 3 for b in b"rev hello="]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = local.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)[0, len(prompt):].tolist()
    report = {}
    for url in urls:
        c = ServerClient(url)
        got = c.weights_checksum(list(want))
        out = c.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8})
        report[url] = dict(
            tensors_equal=got["checksums"] == want,
            version=c.model_info()["weight_version"],
            generate_version=out["meta_info"]["weight_version"],
            answer_equal=out["output_ids"] == expected[: len(out["output_ids"])] and len(out["output_ids"]) > 0,
        )
    return report


class Sabotage:
    """Wraps a WeightSource; on rank 0, after ``after`` tensors of the second publish, runs ``act``."""

    def __init__(self, engine, after: int, act):
        self.engine, self.after, self.act, self.calls = engine, after, act, 0

    def param_specs(self):
        return self.engine.param_specs()

    def iter_full_tensors(self, specs=None):
        for i, item in enumerate(self.engine.iter_full_tensors(specs)):
            self.calls += 1
            if self.engine.rank == 0 and self.calls == self.after:
                self.act()
            yield item
