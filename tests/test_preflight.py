"""A model that does not match the servers is refused before any byte moves (bridge/publisher/preflight.py).

A user's own loop: a Qwen2 built from a config, published by broadcast or disk to reference servers of
the tiny preset. Another architecture (wider MLP, one more layer) or another serving dtype is one
ConfigError on every rank, naming every differing tensor in full and the fix; the server was never
paused (its log says so), serves what it served, and disk wrote and announced nothing.
"""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_ranks

pytestmark = pytest.mark.slow


def _publish_other_model(url: str, transport: str, serving_dtype: str, root: str, other_shapes: bool):
    """One rank: a Qwen2 of the tiny config (or a wider MLP and one more layer), published as version 7."""
    from transformers import AutoModelForCausalLM

    from bridge import PublisherConfig, WeightPublisher
    from bridge.errors import ConfigError
    from bridge.local.presets import build_config

    cfg = build_config("tiny")
    if other_shapes:
        cfg = type(cfg)(**{**cfg.to_dict(), "intermediate_size": 192, "num_hidden_layers": 3, "layer_types": None})
    model = AutoModelForCausalLM.from_config(cfg)
    extra = dict(name_resolve=f"file://{root}/nr", snapshot_root=f"{root}/snap") if transport == "disk" else {}
    pub = WeightPublisher(PublisherConfig(transport=transport, servers=[url], serving_dtype=serving_dtype,
                                          experiment="preflight", progress=False, group_timeout=20, **extra))
    try:
        pub.publish(model, version=7)
    except ConfigError as e:
        return str(e)
    finally:
        pub.close()
    return None


def _paused_lines(server) -> int:
    with open(server.log_path, errors="replace") as f:
        return sum("generation paused" in line for line in f)


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_another_architecture_is_refused_before_any_byte_moves(ref_server, tmp_path, transport):
    before = ref_server.client.weights_checksum()
    paused = _paused_lines(ref_server)
    [message] = run_ranks(_publish_other_model, 1, args=(ref_server.url, transport, "bfloat16", str(tmp_path), True),
                          timeout=120)
    assert message is not None, "a model of other shapes was published"
    assert "the servers do not serve the trainer's model, nothing was sent" in message, message
    # Every difference in full: the wider MLP in each layer, and the third layer the server does not have.
    for layer in (0, 1):
        for proj, shape in (("gate_proj", "[192, 128]"), ("up_proj", "[192, 128]"), ("down_proj", "[128, 192]")):
            assert f"'model.layers.{layer}.mlp.{proj}.weight' is {shape} in the trainer" in message, message
    assert "the trainer sends 12 tensor(s) it does not have" in message and "'model.layers.2.mlp.down_proj.weight'" in message
    assert " more" not in message and "start the server with the trainer's model" in message
    assert _paused_lines(ref_server) == paused, "the server was paused for a model it does not serve"
    assert ref_server.client.weights_checksum() == before
    if transport == "disk":  # nothing written, nothing announced
        assert not os.path.exists(tmp_path / "snap") or not os.listdir(tmp_path / "snap")
        from bridge.name_resolve import make_name_resolve, names

        announced = make_name_resolve(f"file://{tmp_path}/nr").find_subtree(
            names.update_weights_from_disk_root("preflight", "trial0"))
        assert not announced, announced


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_another_serving_dtype_is_refused_before_any_byte_moves(ref_server, tmp_path, transport):
    paused = _paused_lines(ref_server)
    [message] = run_ranks(_publish_other_model, 1, args=(ref_server.url, transport, "float32", str(tmp_path), False),
                          timeout=120)
    assert message is not None and "serves bfloat16 but serving_dtype='float32'" in message, message
    assert "serving_dtype='bfloat16'" in message, message
    assert _paused_lines(ref_server) == paused
    if transport == "disk":  # nothing written (a float32 snapshot the server would refuse), nothing announced
        assert not os.path.exists(tmp_path / "snap") or not os.listdir(tmp_path / "snap")


def test_what_real_sglang_is_asked_is_bounded_whatever_the_model():
    """The probes of /get_weights_by_name (bridge/publisher/preflight_sglang.py): a 28-layer model is asked at most
    MAX_PROBES names: the tensors outside the layers, every tensor of the first layer, one of the last, and
    that one a layer further (which must not exist); a 1-D tensor is asked whole, another one row."""
    import torch

    from bridge.publisher.preflight_sglang import MAX_PROBES, probes
    from bridge.tensors import ParamSpec

    layer = {"self_attn.q_proj.weight": (256, 256), "self_attn.q_proj.bias": (256,), "self_attn.k_proj.weight": (128, 256),
             "self_attn.k_proj.bias": (128,), "self_attn.v_proj.weight": (128, 256), "self_attn.v_proj.bias": (128,),
             "self_attn.o_proj.weight": (256, 256), "mlp.gate_proj.weight": (640, 256), "mlp.up_proj.weight": (640, 256),
             "mlp.down_proj.weight": (256, 640), "input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,)}
    shapes = {"model.embed_tokens.weight": (272, 256), **{f"model.layers.{i}.{n}": s for i in range(28) for n, s in layer.items()},
              "model.norm.weight": (256,), "lm_head.weight": (272, 256)}  # the "many" preset: Qwen2.5-7B's layout
    specs = [ParamSpec(n, s, torch.bfloat16) for n, s in shapes.items()]
    asked = dict(probes(specs))
    assert len(specs) > 300 and len(asked) <= MAX_PROBES
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(asked)
    assert {n for n in asked if ".layers.0." in n} == {s.name for s in specs if ".layers.0." in s.name}
    assert asked["model.layers.27.self_attn.q_proj.weight"] == (256, 256)
    assert asked["model.layers.28.self_attn.q_proj.weight"] is None
    assert not any(f".layers.{i}." in n for n in asked for i in range(1, 27))

