"""What an RL client reads of the weight versions a generation ran on (SGLang 0.5.20+ ``meta_info.weight_versions``).

SGLang's scheduler records, for each request in flight when the version label changes, how many output tokens it
had (``record_weight_version_events``), and reports on every finished request the spans of its tokens under each
version and ``weight_version``, the one it finished on (``sglang/srt/utils/weight_versions.py``, the same file in
0.5.20-0.5.23). Oracles: SGLang 0.5.23's own functions of that file, imported from its tree and run on the same
event sequence, and the tiny preset's greedy continuation (:func:`tests.fixtures_server.greedy`) under the old
and the new weights.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import time

import pytest

from bridge.client.results import generation_versions
from bridge.local.presets import build_model
from tests.fixtures_server import Trainer, greedy, local_model, random_weights
from tests.sglang_harness import installed, sglang_dir

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32]
N = 160
GREEDY = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}


@pytest.fixture(scope="module")
def sglang_wv():
    """SGLang 0.5.23's ``sglang/srt/utils/weight_versions.py``, loaded from its file (with the one module it
    imports, ``msgspec_utils``), without importing the ``sglang`` package."""
    if not installed("0.5.23"):
        pytest.fail("SGLang 0.5.23's code is not installed; run scripts/install_sglang.sh")
    root = f"{sglang_dir('0.5.23')}/sglang/srt/utils"
    added = []
    try:
        for name in ("msgspec_utils", "weight_versions"):
            full = f"sglang.srt.utils.{name}"
            spec = importlib.util.spec_from_file_location(full, f"{root}/{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            added.append(full)
            spec.loader.exec_module(mod)
        yield sys.modules["sglang.srt.utils.weight_versions"]
    finally:
        for full in added:
            sys.modules.pop(full, None)


def sglang_meta(wv, events: list[tuple[str, int]], current: str, n: int) -> dict:
    """What SGLang 0.5.23 puts in ``meta_info`` for these events (scheduler side, then tokenizer side)."""
    spans = wv.compute_weight_version_spans([wv.WeightVersionEvent(old_version=v, num_output_tokens=k)
                                             for v, k in events], current_version=current, num_output_tokens=n)
    meta: dict = {}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
    return meta


@pytest.mark.sglang_code
def test_spans_are_sglangs_for_any_event_sequence(sglang_wv):
    from inference_adapter.generation import add_weight_versions, weight_version_spans

    rng = random.Random(38)
    for _ in range(2000):
        n = rng.randrange(0, 12)
        events, k = [], 0
        for _ in range(rng.randrange(0, 5)):
            k = min(n + 2, k + rng.randrange(0, 4))  # recorded counts grow; some beyond n (then truncated)
            events.append((rng.choice("abc"), k))
        current = rng.choice("abcd")
        meta: dict = {}
        add_weight_versions(meta, weight_version_spans(events, current, n), n)
        assert meta == sglang_meta(sglang_wv, events, current, n), (events, current, n)


def _wait_running(client) -> None:
    deadline = time.monotonic() + 60
    while client.server_info()["internal_states"][0]["running_requests"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _generate_in_background(client) -> tuple[threading.Thread, dict]:
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(r=client.generate(input_ids=PROMPT, sampling_params=GREEDY)))
    th.start()
    _wait_running(client)
    return th, box


def _sync(trainer: Trainer, weights: dict, version: str, session: bool) -> None:
    c = trainer.clients[0]
    if session:
        c.begin_weight_update()
    [r] = trainer.send(list(weights.items()), flattened=True, weight_version=version)
    assert not isinstance(r, Exception), r
    if session:
        c.end_weight_update()


@pytest.mark.sglang_code
def test_a_generation_held_in_place_across_a_sync_reports_the_tokens_of_each_version(server_factory, sglang_wv):
    server = server_factory()
    c = server.client
    w_old, w_new = random_weights(seed=31), random_weights(seed=32)
    with Trainer([c]) as trainer:
        _sync(trainer, w_old, "v-old", session=True)
        th, box = _generate_in_background(c)
        c.pause_generation("in_place")
        _sync(trainer, w_new, "v-new", session=True)
        c.continue_generation()
        th.join(timeout=120)
    out, meta = box["r"]["output_ids"], box["r"]["meta_info"]
    assert len(out) == N and meta["weight_version"] == "v-new"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["v-old", "v-new"], spans
    k = spans[0]["end"]
    assert spans == [{"version": "v-old", "start": 0, "end": k}, {"version": "v-new", "start": k, "end": N}]
    assert generation_versions(box["r"]) == spans  # the client's reading
    assert 0 < k < N, "the pause came before the first token or after the last: nothing was held across the sync"
    # The tokens each span counts are the ones each model generated: the old model's greedy continuation of the
    # prompt up to the swap, then the new model's of the prompt and those tokens.
    assert out[:k] == greedy(local_model(w_old), PROMPT, k, ignore_eos=True)
    assert out[k:] == greedy(local_model(w_new), PROMPT + out[:k], N - k, ignore_eos=True)
    assert meta["num_retractions"] == 0
    want = sglang_meta(sglang_wv, [("v-old", k)], "v-new", N)
    assert {key: meta[key] for key in want} == want


def _relabel_in_place(server) -> dict:
    c = server.client
    th, box = _generate_in_background(c)
    c.pause_generation("in_place")
    c.update_weight_version("inplace-v3", abort_all_requests=False)
    c.continue_generation()
    th.join(timeout=120)
    return box["r"]


@pytest.mark.sglang_code
def test_a_relabel_while_paused_in_place_is_the_version_the_generation_finished_on(server_factory, sglang_wv):
    r = _relabel_in_place(server_factory(extra_args=["--weight-version", "base-v0"]))
    out, meta = r["output_ids"], r["meta_info"]
    k = meta["weight_versions"][0]["end"]
    assert 0 < k < N
    assert meta["weight_version"] == "inplace-v3"
    assert meta["weight_versions"] == [{"version": "base-v0", "start": 0, "end": k},
                                       {"version": "inplace-v3", "start": k, "end": N}]
    assert meta == {**meta, **sglang_meta(sglang_wv, [("base-v0", k)], "inplace-v3", N)}
    # Only the label changed: one model's greedy answer throughout.
    assert out == greedy(build_model("tiny", seed=0).bfloat16().eval(), PROMPT, N, ignore_eos=True)


def test_older_dialects_report_one_version_and_start_again_on_new_weights(server_factory):
    """0.5.8 (before weight_versions.py): no spans; a generation parked in place across a sync starts again from its
    prompt on the new weights, and reports the version it ran on."""
    server = server_factory(extra_args=["--protocol-version", "0.5.8", "--weight-version", "base-v0"])
    c = server.client
    w_new = random_weights(seed=33)
    with Trainer([c]) as trainer:
        th, box = _generate_in_background(c)
        c.pause_generation("in_place")
        _sync(trainer, w_new, "v-new", session=False)
        c.continue_generation()
        th.join(timeout=120)
    meta = box["r"]["meta_info"]
    assert "weight_versions" not in meta and meta["weight_version"] == "v-new"
    assert generation_versions(box["r"]) == [{"version": "v-new", "start": 0, "end": N}]  # one span, every token
    assert box["r"]["output_ids"] == greedy(local_model(w_new), PROMPT, N, ignore_eos=True)


def test_a_stream_held_by_retract_across_a_sync_keeps_the_tokens_it_sent(server_factory):
    """A streamed generation cannot take back what it sent: paused by ``retract`` across a sync, it keeps its tokens
    and goes on under the new weights (as SGLang keeps a retracted request's tokens), where a non-streamed one
    starts again from its prompt. Its tokens (``return_token_ids``, one chunk per token) are the old model's greedy
    ones up to the swap, then the new model's continuation of the prompt and those tokens."""
    import json

    import requests

    server = server_factory()
    c = server.client
    w_old, w_new = random_weights(seed=34), random_weights(seed=35)
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    chunks, first = [], threading.Event()

    def stream():
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
            for ln in r.iter_lines(decode_unicode=True):
                if ln.startswith("data: {"):
                    chunks.append(json.loads(ln.removeprefix("data: "))["choices"][0])
                    first.set()

    with Trainer([c]) as trainer:
        _sync(trainer, w_old, "s-old", session=True)
        th = threading.Thread(target=stream)
        th.start()
        assert first.wait(60), "no chunk came"
        c.pause_generation("retract")
        _sync(trainer, w_new, "s-new", session=True)
        c.continue_generation()
        th.join(timeout=120)
    assert chunks[0]["prompt_token_ids"] == PROMPT and len(chunks) == N
    out = [t for ch in chunks for t in ch["token_ids"]]
    assert len(out) == N and chunks[-1]["finish_reason"] == "length"
    old = greedy(local_model(w_old), PROMPT, N, ignore_eos=True)
    k = next(k for k in range(N + 1) if k == N or out[k] != old[k])  # the first token that is not the old model's
    assert 0 < k < N, "the pause came before the first token or after the last: nothing was held across the sync"
    assert out[k:] == greedy(local_model(w_new), PROMPT + out[:k], N - k, ignore_eos=True)
