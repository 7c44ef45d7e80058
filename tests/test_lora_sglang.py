"""LoRA adapters into SGLang 0.5.23's own adapter code (the ``sglang_code`` tier; issue 37).

One harness server per module (:mod:`tests.sglang_harness.serve` ``--enable-lora``, what runs and what is stubbed
in :mod:`tests.sglang_harness.lora_serve`): SGLang's HTTP app parses the client's bodies, its tokenizer manager,
``LoRARegistry``, scheduler, worker (the allowlisted unpickler, the ``expected_checksums`` check) and
``LoRAManager`` load and unload the adapter, and the harness reports the sha256 of every tensor SGLang's
``LoRAAdapter`` was handed.

Then what the client's replace (unload, then load: SGLang refuses a name that is loaded) does on SGLang's own
code with generations asking for the adapter by its stable name.
"""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_ranks
from tests.test_lora import lora_engine

pytestmark = pytest.mark.sglang_code

PROMPT = [5, 17, 42, 9, 3, 77]


@pytest.fixture(scope="module")
def sglang_lora(tiny_model_dir):
    from tests.sglang_harness import installed, launch

    assert installed("0.5.23"), "SGLang 0.5.23 is not installed: run scripts/install_sglang.sh"
    with launch("0.5.23", tiny_model_dir, extra_args=["--enable-lora", "--max-lora-rank", "16"]) as s:
        yield s


def _publish_into_sglang(url: str, root: str, nr_url: str):
    """Two publishes by tensors, then two by disk, each after a training step; rank 0 reads, after each, what
    SGLang's code holds under the name and asks for a generation with the adapter."""
    from bridge import AdapterPublisher, AdapterPublisherConfig
    from bridge.client import ServerClient
    from bridge.protocol import tensor_checksum
    from tests.sync_bodies import train_step

    engine = lora_engine()
    checks = []
    try:
        for via in ("tensors", "disk"):
            name = f"policy-{via}"
            pub = AdapterPublisher(AdapterPublisherConfig(name=name, via=via, servers=[url], root=root,
                                                          name_resolve=nr_url))
            try:
                for version in (1, 2):
                    train_step(engine, seed=version)
                    res = pub.publish(engine, version=version)
                    mine = engine.gather_adapter()  # collective
                    if mine is None:
                        continue
                    import requests

                    view = requests.get(url + "/wsync_harness/lora", timeout=30).json()
                    c = ServerClient(url)
                    try:
                        out = c.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, lora_path=name)
                    finally:
                        c.close()
                    checks.append(dict(via=via, version=res.version, served=view["loaded"].get(name),
                                       registry_id=view["registry"].get(name),
                                       want={n: tensor_checksum(t) for n, t in mine.items()},
                                       generation_id=out["meta_info"].get("harness_lora_id")))
            finally:
                pub.close()
        return checks
    finally:
        engine.destroy()


def test_publisher_loads_the_trainers_adapter_through_sglang_own_code(sglang_lora, tmp_path):
    """By tensors and by disk, a first load and a replace: SGLang's app, registry and LoRAManager hold the adapter
    under its stable name, every tensor SGLang's LoRAAdapter was handed equal to the trainer's, and a generation
    asking for the name acquires that adapter."""
    checks, _ = run_ranks(_publish_into_sglang, 2, args=(sglang_lora.url, str(tmp_path / "adapters"),
                                                         f"file://{tmp_path}/nr"), timeout=240)
    assert [(c["via"], c["version"]) for c in checks] == [("tensors", 1), ("tensors", 2), ("disk", 1), ("disk", 2)]
    ids = set()
    for c in checks:
        served = c["served"]
        assert served is not None, (c["via"], c["version"], sglang_lora.log_tail())
        assert served["checksums"] == c["want"], (c["via"], c["version"])
        assert len(c["want"]) == 28 and served["r"] == 4  # A and B of 7 projections on 2 layers
        assert served["lora_id"] == c["registry_id"] == c["generation_id"]
        want_path = "__tensor__" if c["via"] == "tensors" else os.path.join("policy-disk", f"v{c['version']}")
        assert served["lora_path"].endswith(want_path), served["lora_path"]
        ids.add(served["lora_id"])
    assert len(ids) == 4  # every publish a load of its own
