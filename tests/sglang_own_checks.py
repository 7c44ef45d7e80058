"""SGLang's own HTTP weight-update tests, step by step and check by check, against any server of SGLang's protocol.

Each ``check_*`` here is one HTTP test of SGLang's ``test/srt`` (named in its docstring): the requests it sends, in
its order, and the assertions it makes, written anew (SGLang's code is not copied). The real tier runs them against
real SGLang 0.5.23 on CPU (``tests/test_real_sglang.py``), ``tests/test_sglang_own_tests.py`` against the reference
server, so where the two answer otherwise, these checks say which.

Adapted where SGLang's tests assume what this machine has not, and nothing else:

- the model: a local preset directory instead of the hub's ``Llama-3.2-1B-Instruct``, and for SGLang's "the same
  model without ``-Instruct``" the preset's weights of another seed (same architecture, other weights);
- tensors: CPU tensors shared with torch's ``file_system`` strategy (SGLang's path for same-host CPU tensors) where
  SGLang's test makes them on ``cuda``; the layers written are the model's own (the tiny model has two);
- load: 4 generating clients, each asking for the tokens this server decodes in about twice SGLang's wait of 2 s
  (at most 900): 32 clients of 3000-16000 tokens are sized for a GPU (real SGLang on these CPUs decodes about 250
  tokens a second for 8 clients, the reference server 30);
- a shared server: each check puts back the weights it found (SGLang's tests own their server), from the model
  directory the server reports.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import subprocess
import sys
import time

import numpy as np
import requests
import torch

PROMPT = "The capital of France is"
STARTED_S = 2.0  # SGLang's tests sleep this long for the decodes to start
CLIENTS = 4
MOST_TOKENS = 900  # each client's most: 4 of them fit the launcher's --max-total-tokens 4096 on CPU


def decode(url: str, text: str = PROMPT, max_new_tokens: int = 32, ignore_eos: bool = False) -> dict:
    """``/generate`` greedy, as SGLang's ``run_decode``."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    if ignore_eos:
        params["ignore_eos"] = True
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": params}, timeout=600)
    return r.json()


def model_path(url: str) -> str:
    """``/get_model_info``'s ``model_path``, as SGLang's ``get_model_info``."""
    return requests.get(url + "/get_model_info", timeout=60).json()["model_path"]


def update_from_disk(url: str, path: str, **fields) -> dict:
    r = requests.post(url + "/update_weights_from_disk", json={"model_path": path, **fields}, timeout=600)
    return r.json()


def long_tokens(url: str, clients: int = CLIENTS, waits: float = 3) -> int:
    """New tokens of a generation still running after SGLang's wait: what each of ``clients`` generations at once
    decodes on this server in ``waits`` waits (a machine whose load falls after the measure decodes faster), measured
    on ``clients`` decodes of 64 at once, as the checks run them (SGLang batches them; the reference server decodes
    each on its own thread), at least 64, at most the generations' share of the launcher's token pool
    (:data:`MOST_TOKENS` each for :data:`CLIENTS`: one alone may take all of it, within the presets' context of 2048,
    and on idle cores it decodes 900 tokens within the second a check waits)."""
    t = time.monotonic()
    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda _: decode(url, max_new_tokens=64, ignore_eos=True), range(clients)))
    most = min(2000, MOST_TOKENS * CLIENTS // max(1, clients))
    return max(64, min(most, int(64 / (time.monotonic() - t) * waits * STARTED_S)))


_SENDER = r"""
import base64, io, sys, torch
from multiprocessing.reduction import ForkingPickler
torch.multiprocessing.set_sharing_strategy("file_system")
shape, names = tuple(int(d) for d in sys.argv[1].split("x")), sys.argv[2:]
tensor = torch.full(shape, 1.5)
buf = io.BytesIO()
ForkingPickler(buf).dump([(name, tensor) for name in names])
print(base64.b64encode(buf.getvalue()).decode(), flush=True)
sys.stdin.readline()
"""


class SharedTensors:
    """``[(name, torch.full(shape, 1.5)) for name in names]`` in SGLang's ``MultiprocessingSerializer`` form (torch's
    ForkingPickler, base64), made and kept alive by a process of its own, as a trainer would hold them: the test's
    process never starts torch's ``torch_shm_manager``, which would outlive it holding its output open."""

    def __init__(self, names: list[str], shape: tuple[int, ...]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SENDER, "x".join(map(str, shape)), *names],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.payload = self.proc.stdout.readline().strip()
        assert self.payload, "the process sharing the tensors ended without a payload"

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc.wait(30)


def check_update_weights(url: str, other: str) -> None:
    """``test_update_weights_from_disk.py``, ``TestServerUpdateWeightsFromDisk.test_update_weights``: load another
    model's weights from disk (``model_path`` follows, the answer changes), then the first one's again (the answer is
    the first one's)."""
    origin = model_path(url)
    origin_text = decode(url)["text"]
    ret = update_from_disk(url, other)
    assert ret["success"], ret
    assert model_path(url) == other != origin
    assert decode(url)["text"][:32] != origin_text[:32]
    ret = update_from_disk(url, origin)
    assert ret["success"], ret
    assert model_path(url) == origin
    assert decode(url)["text"][:32] == origin_text[:32]


def check_update_weights_unexist_model(url: str) -> None:
    """``TestServerUpdateWeightsFromDisk.test_update_weights_unexist_model``: a path that does not exist answers
    ``success: false``; ``model_path`` and the answer are unchanged."""
    origin = model_path(url)
    origin_text = decode(url)["text"]
    ret = update_from_disk(url, origin.rstrip("/") + "wrong")
    assert not ret["success"], ret
    assert model_path(url) == origin
    assert decode(url)["text"][:32] == origin_text[:32]


def check_update_weights_abort_all_requests(url: str, other: str) -> None:
    """``TestServerUpdateWeightsFromDiskAbortAllRequests.test_update_weights_abort_all_requests``: an update from disk
    with ``abort_all_requests`` while clients generate: it succeeds, every generation ends ``abort``, ``model_path``
    follows. Then the first weights are put back."""
    # Eight waits: these generations are aborted, so tokens to spare cost nothing, and a load that falls between the
    # measure and the update (the rest of the suite ending) must not let them finish first.
    origin, n = model_path(url), long_tokens(url, waits=8)
    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(decode, url, max_new_tokens=n, ignore_eos=True) for _ in range(CLIENTS)]
        time.sleep(STARTED_S)
        ret = update_from_disk(url, other, abort_all_requests=True)
        flushed_late = not ret["success"] and "the cache was not flushed" in ret.get("message", "")
        if flushed_late:
            # On CPU the aborted generations leave the batch at the scheduler's next decoding step, which can come
            # after SGLang's idle check; the weights were updated, and SGLang's message says what to do: flush once
            # they are gone.
            _flush_when_idle(url)
        else:
            assert ret["success"], ret
        reasons = [f.result()["meta_info"]["finish_reason"]["type"] for f in cf.as_completed(futures)]
    assert reasons == ["abort"] * CLIENTS, reasons
    # SGLang's tokenizer manager records the new model_path only for an update that answered success: with the flush
    # refused, the weights are the other model's and the path still the first one's.
    assert other != origin and model_path(url) == (origin if flushed_late else other)
    assert update_from_disk(url, origin)["success"]


def _flush_when_idle(url: str, timeout: float = 30.0) -> None:
    """``/flush_cache`` until it succeeds (SGLang answers 400 while requests run), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (r := requests.post(url + "/flush_cache", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, f"/flush_cache still refused after {timeout:g} s: {r.status_code} {r.text}"
        time.sleep(0.2)


def check_update_weights_from_tensor_non_blocking(url: str, names: list[str], shape: tuple[int, ...]) -> None:
    """``test_update_weights_from_tensor.py``, ``TestServerUpdateWeightsFromTensorNonBlocking.test_update_weights``:
    for each pause mode (``in_place``, ``retract``), while clients generate: pause, ``/update_weights_from_tensor``
    with every ``names`` set to float32 1.5 (``flush_cache`` with ``retract`` only), continue; no generation ends
    ``abort`` and ``/get_weights_by_name`` reads 1.5. The update runs in the session SGLang 0.5.21+ requires for it
    (``/begin_weight_update``, ``/end_weight_update``: SGLang's #28001) where the server has one. Then the first weights are put back from disk."""
    origin, n = model_path(url), long_tokens(url)
    for mode in ("in_place", "retract"):
        with cf.ThreadPoolExecutor(CLIENTS) as pool, SharedTensors(names, shape) as tensors:
            futures = [pool.submit(decode, url, f"Question: {random.randint(0, 100)},{PROMPT}", n, True)
                       for _ in range(CLIENTS)]
            time.sleep(STARTED_S)
            requests.post(url + "/pause_generation", json={"mode": mode}, timeout=60)
            session = requests.post(url + "/begin_weight_update", json={}, timeout=60).status_code != 404
            ret = requests.post(url + "/update_weights_from_tensor", timeout=600, json={
                "serialized_named_tensors": [tensors.payload], "flush_cache": mode == "retract"}).json()
            if session:
                requests.post(url + "/end_weight_update", json={}, timeout=60)
            assert ret["success"], (mode, ret)
            requests.post(url + "/continue_generation", json={}, timeout=60)
            reasons = [f.result()["meta_info"]["finish_reason"]["type"] for f in cf.as_completed(futures)]
            assert "abort" not in reasons, (mode, reasons)
        for name in names[:3]:
            got = torch.tensor(requests.post(url + "/get_weights_by_name", json={"name": name},
                                             timeout=60).json())[0, :5]
            assert torch.allclose(got, torch.tensor([1.5] * 5), atol=0.002), (mode, name, got)
    assert update_from_disk(url, origin)["success"]


def check_get_weights_by_name(url: str, hf_model, names: list[str], truncate_size: int = 100) -> None:
    """``test_get_weights_by_name.py``, ``TestGetWeightsByName`` (the ``Runtime`` backend): ``GET
    /get_weights_by_name`` with a JSON body gives the first ``truncate_size`` rows of each tensor as transformers
    loads it (bfloat16) from the directory the server serves, within 1e-5; with tied embeddings ``lm_head.weight``
    reads as the embedding."""
    for name in names:
        want = hf_model.get_parameter(name)[:truncate_size].detach().float().numpy()
        got = requests.get(url + "/get_weights_by_name", json={"name": name, "truncate_size": truncate_size},
                           timeout=60).json()
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
    if hf_model.config.tie_word_embeddings:
        got = requests.get(url + "/get_weights_by_name", json={"name": "lm_head.weight",
                                                               "truncate_size": truncate_size}, timeout=60).json()
        embed = hf_model.get_parameter("model.embed_tokens.weight")[:truncate_size].detach().float().numpy()
        assert np.allclose(embed, np.array(got))


def parameters(num_layers: int) -> list[str]:
    """SGLang's list for ``test_get_weights_by_name`` (one kind of tensor per layer, layers 0-8), over the model's own
    layers."""
    kinds = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"]
    return (["model.embed_tokens.weight"]
            + [f"model.layers.{i % num_layers}.{k}.weight" for i, k in enumerate(kinds)]
            + ["model.norm.weight", "lm_head.weight"])


def run_all(url: str, other: str) -> None:
    """Every check above against the server at ``url`` (serving a directory of a Llama-style preset; ``other``: the
    same preset's directory with other weights)."""
    from transformers import AutoModelForCausalLM

    origin = model_path(url)
    assert update_from_disk(url, origin)["success"]  # a shared server: the directory's weights, as started
    hf = AutoModelForCausalLM.from_pretrained(origin, dtype=torch.bfloat16)
    layers = hf.config.num_hidden_layers
    check_get_weights_by_name(url, hf, parameters(layers))
    check_update_weights(url, other)
    check_update_weights_unexist_model(url)
    check_update_weights_abort_all_requests(url, other)
    up = hf.get_parameter("model.layers.0.mlp.up_proj.weight")
    check_update_weights_from_tensor_non_blocking(url, [f"model.layers.{i}.mlp.up_proj.weight" for i in range(layers)],
                                                  tuple(up.shape))
