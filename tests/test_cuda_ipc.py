"""The colocated transport's GPU half: SGLang's flattened-bucket payload, checked by SGLang's own code.

CPU tier (``sglang_code``): the payload the project builds (:mod:`bridge.transports.cuda_ipc`, with SGLang's
own ``FlattenedTensorBucket`` and ``MultiprocessingSerializer``) for buckets of CPU tensors is received, rank
by rank, by SGLang's own receive code in one process (its TP worker's deserializer and its runner's
``update_weights_from_tensor``, 0.5.23 and 0.5.6), and is loaded by SGLang 0.5.23's and 0.5.6's own receive code
and Qwen2 loader over HTTP (the harness server), whose served (stacked) weights must be bit-equal. Both run in processes of
their own where SGLang imports (:mod:`tests.sglang_harness.ipc_payload`). On CPU the tensors cross processes
as shared-memory files; the CUDA IPC handles themselves need a GPU.

GPU tier (``gpu``): the payload of CUDA tensors -- real CUDA IPC handles -- is opened on the same GPU by SGLang's
own receive code (0.5.23 and 0.5.6, from the CPU tier's copies) in a process other than the trainer's and loaded
bit-equal; and, where real SGLang is installed, a trainer on a CUDA device publishes with
``transport="colocated"`` into a real SGLang server on the same host, end to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from tests.sglang_harness import ROOT, installed, launch, sglang_dir

IPC_VERSIONS = ("0.5.23", "0.5.6")  # SGLang >= 0.5.6 takes flattened buckets; the payload needs it


def _need(version: str) -> None:
    if not installed(version):
        pytest.skip(f"SGLang {version} is not installed (bash scripts/install_sglang.sh)")


def _start(version: str, *args: str, timeout: float = 240) -> tuple[int, str, str]:
    """Run :mod:`tests.sglang_harness.ipc_payload` with SGLang ``version`` importable: exit status, stdout, stderr.

    Output goes to files, not pipes: torch's shared-memory manager, which the sender starts, inherits them
    and lives as long as the server holds its files, so a pipe would not close when the sender exits."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        rc = subprocess.run([sys.executable, "-m", "tests.sglang_harness.ipc_payload", *args, "--sglang-dir",
                             sglang_dir(version)], cwd=ROOT, env=env, stdout=out, stderr=err, timeout=timeout).returncode
        out.seek(0)
        err.seek(0)
        return rc, out.read(), err.read()


def _answer(rc: int, stdout: str, stderr: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("IPC_PAYLOAD ")]
    assert rc == 0 and lines, f"exit {rc}:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("IPC_PAYLOAD "))


def _run(version: str, *args: str, timeout: float = 240) -> dict:
    """:func:`_start`'s JSON answer; fails with the process's output when there is none."""
    return _answer(*_start(version, *args, timeout=timeout))


@pytest.mark.sglang_code
@pytest.mark.parametrize("version", IPC_VERSIONS)
def test_payload_decodes_with_sglang_own_deserializer(version, tiny_model_dir):
    """Every TP rank's entry, handed to SGLang's own receive code (its TP worker's deserializer, SafeUnpickler,
    and its runner's ``update_weights_from_tensor`` with the flattened-bucket unflattening), reaches the model's
    ``load_weights`` as the bucket's tensors: same names in order, dtypes, shapes and bytes (bf16, fp16, fp32,
    int64, int32, bool, a scalar, an empty tensor, a tied pair), flattened and per tensor."""
    _need(version)
    out = _run(version, "decode", "--tp-size", "3", "--model", tiny_model_dir)
    buckets = out["buckets"]
    assert len(buckets) >= 4 and {b["flattened"] for b in buckets} == {True, False}
    seen = set()
    for b in buckets:
        assert b["entry_types"] == ["str"]  # base64 text, sent in the JSON body as is
        assert len(b["ranks"]) == 3
        for rank in b["ranks"]:
            assert rank == b["sent"]
        seen |= {n for n, *_ in b["sent"]}
    dtypes = {d for b in buckets for _, d, _, _ in b["sent"]}
    assert {"bfloat16", "float16", "float32", "int64", "int32", "bool"} <= dtypes
    assert {"model.embed_tokens.weight", "lm_head.weight", "layers.0.scale", "layers.0.empty"} <= seen
    # The device-UUID patch a CUDA payload is built under is scoped: active inside, undone after, and a
    # patch the trainer applied itself is kept.
    assert out["uuid_patch"] == {"inside": True, "restored": True, "kept": True}


@pytest.fixture(scope="module")
def sglang_servers(tiny_model_dir):
    """``get(version)``: one SGLang-code server per release, started on first use, shared by the module."""
    started: dict = {}
    with contextlib.ExitStack() as stack:
        def get(version: str):
            _need(version)
            if version not in started:
                started[version] = stack.enter_context(launch(version, tiny_model_dir))
            return started[version]

        yield get


@pytest.mark.sglang_code
@pytest.mark.parametrize("load_format", ["flattened_bucket", "per_tensor"])
@pytest.mark.parametrize("version", IPC_VERSIONS)
def test_sglang_receive_code_serves_payload_bit_equal(version, load_format, tiny_model_dir, sglang_servers):
    """SGLang's own ``/update_weights_from_tensor`` path (HTTP app, tokenizer and scheduler side, model runner's
    ``deserialize`` + ``_update_weights_from_flattened_bucket`` or per-tensor load) takes the project's payload,
    bucket by bucket in one session; every served tensor is then bit-equal to the one sent."""
    srv = sglang_servers(version)
    sent = _run(version, "send", "--url", srv.url, "--model", tiny_model_dir, "--load-format", load_format)
    assert srv.alive(), srv.log_tail()
    served = srv.checksums()
    assert sent["buckets"] > 1
    assert served["weight_version"] == "ipc1"
    got, want = served["checksums"], sent["checksums"]
    assert set(got) <= set(want)
    assert [n for n in got if got[n] != want[n]] == []
    assert any(".qkv_proj." in n for n in got) and any(".gate_up_proj." in n for n in got)  # SGLang's Qwen2 stacking
    assert "lm_head.weight" not in got or got["lm_head.weight"] == want["model.embed_tokens.weight"]


@pytest.mark.sglang_code
def test_reference_server_takes_sglang_serializer_payload(tiny_model_dir, server_factory):
    """The reference server takes the flattened payload SGLang 0.5.23's own ``MultiprocessingSerializer`` and
    ``FlattenedTensorBucket`` built of same-host CPU tensors, bucket by bucket in one session, as SGLang's receive
    code takes it above; every served tensor is then bit-equal to the one sent. (The per-tensor list:
    ``tests/test_colocated.py``.)"""
    load_format = "flattened_bucket"
    _need("0.5.23")
    srv = server_factory.many([dict(model=tiny_model_dir)])[0]
    sent = _run("0.5.23", "send", "--url", srv.url, "--model", tiny_model_dir, "--load-format", load_format)
    c = srv.client
    assert c.model_info()["weight_version"] == "ipc1"
    got, want = c.weights_checksum()["checksums"], sent["hf_checksums"]
    assert sent["buckets"] > 1 and set(got) <= set(want) and len(got) >= len(want) - 1  # lm_head: tied
    assert [n for n in got if got[n] != want[n]] == []


# ---------------------------------------------------------------------------------------------- refusals


def _refused(urls: list[str], match: str, model_dir: str) -> None:
    """A colocated publish of the servers' own model to ``urls`` raises ConfigError matching ``match``;
    nothing reached a server."""
    from transformers import AutoModelForCausalLM

    from bridge import PublisherConfig, WeightPublisher
    from bridge.client import ServerGroup
    from bridge.errors import ConfigError

    before = ServerGroup(urls).weight_versions()
    pub = WeightPublisher(PublisherConfig(transport="colocated", servers=urls, progress=False))
    try:
        with pytest.raises(ConfigError, match=match):
            pub.publish(AutoModelForCausalLM.from_pretrained(model_dir), version=1)
    finally:
        pub.close()
    assert ServerGroup(urls).weight_versions() == before


@pytest.mark.sglang_code
def test_colocated_refuses_sglang_older_than_flattened_buckets(tiny_model_dir):
    """SGLang 0.4.9 can take neither payload: not CUDA IPC (its module paths differ), nor shared memory from a
    trainer without CUDA (it moves every tensor to CUDA): refused before anything moves, naming the release
    it needs for the route this host takes (0.5.6 with CUDA, 0.5.1 without)."""
    _need("0.4.9")
    with launch("0.4.9", tiny_model_dir) as srv:
        _refused([srv.url], r"SGLang >= 0\.5\.6" if torch.cuda.is_available() else r"SGLang >= 0\.5\.1", tiny_model_dir)
        assert srv.alive()


@pytest.mark.sglang_code
def test_colocated_refuses_a_mix_of_reference_and_real_servers(tiny_model_dir, server_factory, sglang_servers):
    """Shared-memory files for one, CUDA IPC for the other: one publisher takes one kind."""
    srv = sglang_servers("0.5.23")
    ref = server_factory.many([dict(model=tiny_model_dir)])[0]
    _refused([ref.url, srv.url], "mixes", tiny_model_dir)
    assert srv.alive() and ref.alive()


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("version", IPC_VERSIONS)
def test_cuda_ipc_payload_opens_in_sglang_own_receive_code(version, tiny_model_dir):
    """A GPU: the trainer's buckets of CUDA tensors (bf16, fp16, fp32, int64, int32, bool, a scalar, an empty
    tensor, a tied pair, a 3 MiB layer), serialized by :func:`bridge.transports.cuda_ipc.serialize_bucket` for 2
    TP ranks, carry CUDA IPC handles naming the GPU by UUID; SGLang's own receive code in another process opens
    them on that GPU and loads every tensor bit-equal (names in order, dtypes, shapes, bytes), flattened and per
    tensor. SGLang's modules import as on a GPU host; where a release's CUDA-only imports fail on this host (no
    sgl_kernel, flashinfer, ...), they import as in the CPU harness instead, and the test says so."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the payload's CUDA IPC handles)")
    _need(version)
    import_failures = {}
    for imports in ("cuda", "cpu"):
        rc, stdout, stderr = _start(version, "cuda", "--imports", imports, "--tp-size", "2", "--model", tiny_model_dir,
                                    timeout=420)
        if rc != 3 or "SGLANG_IMPORT_FAILED" not in stdout:
            break
        import_failures[imports] = (stdout + stderr)[-1500:]
    out = _answer(rc, stdout, stderr)
    buckets = out["buckets"]
    report = {"version": version, "imports": out["imports"], "gpu": out["gpu"], "torch": out["torch"],
              "payloads": len(buckets), "tensors": sum(len(b["sent"]) for b in buckets) // 2,  # 2 formats each
              "elements": sum(int(np.prod(s)) for b in buckets for _, _, s, _ in b["sent"]) // 2,  # 2 formats
              "import_failures": import_failures}
    print("CUDA_IPC_REPORT " + json.dumps(report))
    assert out["sender_pid"] != out["receiver_pid"]
    assert len(buckets) >= 4 and {b["flattened"] for b in buckets} == {True, False}
    for b in buckets:
        assert b["entry_types"] == ["str"] and b["cuda_rebuild"] and b["device_uuid"], b
        assert len(b["ranks"]) == 2
        for rank in b["ranks"]:
            assert rank == b["sent"]
        assert b["devices"] == ["cuda:0"], b["devices"]  # opened on the trainer's GPU, not copied to the CPU
    dtypes = {d for b in buckets for _, d, _, _ in b["sent"]}
    assert {"bfloat16", "float16", "float32", "int64", "int32", "bool"} <= dtypes
    assert any(n == "layers.1.mlp.down_proj.weight" for b in buckets for n, *_ in b["sent"])


def _cuda_and_sglang() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from inference_adapter import sglang_available

    if not sglang_available():
        return "needs sglang installed (pip install sglang) on this CUDA host"
    return None


NO_GPU = _cuda_and_sglang()


def _llama_dir(path) -> str:
    """The tiny preset's sizes as a Llama model: SGLang's Llama answers ``/get_weights_by_name`` (its Qwen2 does
    not), so the served weights can be read back. Untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bridge.local.presets import build_config, build_tokenizer

    q = build_config("tiny")
    cfg = LlamaConfig(vocab_size=q.vocab_size, hidden_size=q.hidden_size, intermediate_size=q.intermediate_size,
                      num_hidden_layers=q.num_hidden_layers, num_attention_heads=q.num_attention_heads,
                      num_key_value_heads=q.num_key_value_heads, max_position_embeddings=q.max_position_embeddings,
                      rms_norm_eps=q.rms_norm_eps, tie_word_embeddings=False, pad_token_id=q.pad_token_id,
                      bos_token_id=q.bos_token_id, eos_token_id=q.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _publish_and_check(model_dir: str, extra_args=(), versions=(1, 2)):
    """Publish ``versions`` from a trainer on this GPU into a real SGLang server; read the weights back."""
    from transformers import AutoModelForCausalLM

    from bridge import PublisherConfig, WeightPublisher
    from inference_adapter import launch_server

    # The trainer shares the GPU with the server: leave it memory (SGLang takes most of the free memory otherwise).
    extra_args = ["--mem-fraction-static", "0.5", *extra_args]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to("cuda")
    params = dict(model.named_parameters())
    with launch_server(model=model_dir, use_sglang=True, ready_timeout=900, extra_args=extra_args) as s:
        assert s.kind == "sglang"
        pub = WeightPublisher(PublisherConfig(transport="colocated", servers=[s.url], bucket_mb=0.25, progress=False))
        try:
            for v in versions:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5).add_(0.01 * v)
                res = pub.publish(model, version=v)
                assert res.servers == {s.url: "ok"} and res.buckets > 1
                assert s.client.model_info()["weight_version"] == str(v)
                for name in ("model.norm.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
                             "lm_head.weight"):
                    want = params[name].detach().to(torch.bfloat16).float().reshape(-1).cpu()
                    got = torch.tensor(s.client.get_weights_by_name(name, truncate_size=64)).reshape(-1)
                    assert torch.equal(got, want[: got.numel()]), f"v{v}: served {name} differs from the trainer's"
        finally:
            pub.close()
        assert s.alive(), s.log_tail()


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
def test_colocated_cuda_ipc_publish_into_real_sglang(tmp_path):
    """GPU host: the trainer's buckets reach a real SGLang server as CUDA IPC flattened buckets; the served
    weights equal the trainer's and the version is live, twice in a row."""
    _publish_and_check(_llama_dir(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for a TP=2 server")
def test_colocated_cuda_ipc_publish_into_real_sglang_tp2(tmp_path):
    """Two GPUs: a TP=2 server gets one entry per TP rank, each rank opening its own handles."""
    _publish_and_check(_llama_dir(tmp_path), extra_args=["--tp-size", "2"], versions=(1,))
