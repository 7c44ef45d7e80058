"""SGLang's OpenAI-compatible routes on the reference server: ``/v1/completions`` and ``/v1/chat/completions``.

What an RL client reads there: the answer (the served model's own greedy continuation, :func:`greedy`) and
``metadata``, built as SGLang 0.5.23's ``build_endpoint_weight_version_metadata`` builds it from the first choice's
``meta_info`` (``weight_version``, and ``weight_versions`` from 0.5.20; ``{"weight_version"}`` alone in 0.5.1-0.5.19;
none before). A tokenizer without a chat template gets SGLang's answer, a 400 naming that.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import requests

from bridge.client.results import generation_versions
from bridge.local.presets import build_tokenizer, make_model_dir
from tests.fixtures_server import Trainer, greedy, local_model, random_weights

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32]
N = 12
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def _post(server, route: str, body: dict) -> requests.Response:
    return requests.post(server.url + route, json=body, timeout=60)


def _publish(server, weights: dict, version: str) -> None:
    c = server.client
    with Trainer([c]) as trainer:
        c.begin_weight_update()
        [r] = trainer.send(list(weights.items()), flattened=True, weight_version=version)
        assert not isinstance(r, Exception), r
        c.end_weight_update()


def _chat_prompt() -> list[int]:
    tok = build_tokenizer()
    text = tok.apply_chat_template([MESSAGES[0], {"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_both_routes_report_the_served_version_after_a_publish(ref_server):
    w = random_weights(seed=41)
    _publish(ref_server, w, "oa-v1")
    model, tok = local_model(w), build_tokenizer()
    spans = [{"version": "oa-v1", "start": 0, "end": N}]

    r = _post(ref_server, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                               "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["metadata"] == {"weight_version": "oa-v1", "weight_versions": spans}
    assert generation_versions(body) == spans
    [choice] = body["choices"]
    assert choice["text"] == tok.decode(greedy(model, PROMPT, N, ignore_eos=True))
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == N
    assert body["usage"]["prompt_tokens"] == len(PROMPT)

    r = _post(ref_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": N, "temperature": 0,
                                                    "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["metadata"] == {"weight_version": "oa-v1", "weight_versions": spans}
    [choice] = body["choices"]
    prompt = _chat_prompt()
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == tok.decode(greedy(model, prompt, N, ignore_eos=True))
    assert body["usage"]["prompt_tokens"] == len(prompt)


def _sglang_fields(path: str, cls: str) -> set[str]:
    """The fields SGLang 0.5.23 declares on ``cls`` in its ``path`` (under ``srt/entrypoints/openai``), read from
    its source."""
    import ast

    from tests.sglang_harness import installed, sglang_dir

    if not installed("0.5.23"):
        pytest.skip("SGLang 0.5.23 is not installed (bash scripts/install_sglang.sh)")
    tree = ast.parse(open(os.path.join(sglang_dir("0.5.23"), "sglang/srt/entrypoints/openai", path)).read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {st.target.id for st in node.body if isinstance(st, ast.AnnAssign) and not st.target.id.startswith("_")}


def _stream(server, route: str, body: dict, on_first=None) -> list:
    """The stream's chunks (decoded JSON), checking SSE framing and the final ``data: [DONE]``."""
    with requests.post(server.url + route, json=body, timeout=60, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        lines = []
        for ln in r.iter_lines(decode_unicode=True):
            if ln:
                lines.append(ln)
                if len(lines) == 1 and on_first is not None:
                    on_first()
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_streams_are_shaped_as_sglangs_and_carry_the_answer(ref_server):
    """``stream: true`` on both routes: SGLang 0.5.23's chunk shapes (fields read from its source), one
    completion chunk per token, the chat's role chunk first and finish chunk last, the same text as the
    non-streamed answer, usage last, and no ``metadata`` (SGLang streams none)."""
    body = {"model": "m", "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = _stream(ref_server, "/v1/completions", {**body, "prompt": PROMPT})
    plain = _post(ref_server, "/v1/completions", {**body, "prompt": PROMPT, "stream": False}).json()
    content, usage = chunks[:-1], chunks[-1]
    assert len(content) == N  # one per token
    assert {frozenset(c) for c in content} == {frozenset(_sglang_fields("protocol.py", "CompletionStreamResponse"))}
    assert {frozenset(ch) for c in content for ch in c["choices"]} == {
        frozenset(_sglang_fields("protocol.py", "CompletionResponseStreamChoice"))}
    assert "".join(c["choices"][0]["text"] for c in content) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (N - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == N
    assert "metadata" in plain and not any("metadata" in c for c in chunks)

    chunks = _stream(ref_server, "/v1/chat/completions", {**body, "messages": MESSAGES})
    plain = _post(ref_server, "/v1/chat/completions", {**body, "messages": MESSAGES, "stream": False}).json()
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {frozenset(ch) for ch in choices} == {frozenset(_sglang_fields("sse_utils.py", "StreamChoice"))}
    assert choices[0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert "".join(ch["delta"].get("content") or "" for ch in choices) == plain["choices"][0]["message"]["content"]
    assert [ch["finish_reason"] for ch in choices] == [None] * (len(choices) - 1) + ["length"]
    assert choices[-1]["delta"] == {"reasoning_content": None}
    assert chunks[-1]["usage"]["completion_tokens"] == N and not any("metadata" in c for c in chunks)


def test_a_stream_sends_tokens_before_the_generation_ends(ref_server):
    """The first chunk arrives while the generation runs: aborting it then (by its rid) ends the stream with
    ``finish_reason`` abort and fewer tokens than asked."""
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True,
            "rid": "stream-abort-1", "stream_options": {"include_usage": True}}

    def abort():
        assert _post(ref_server, "/abort_request", {"rid": "stream-abort-1"}).status_code == 200

    chunks = _stream(ref_server, "/v1/completions", body, on_first=abort)
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert chunks[-1]["usage"]["completion_tokens"] < 2000


def test_generate_streams_each_token_as_sglang_does(ref_server):
    """``/generate`` with ``stream: true``: a chunk per token as it comes, each the whole answer so far with
    ``finish_reason`` null, the last one the finished answer, equal to the non-streamed one (as SGLang's
    tokenizer side streams it); a batch's chunks carry their prompt's ``index``."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    plain = _post(ref_server, "/generate", body).json()
    chunks = _stream(ref_server, "/generate", {**body, "stream": True})
    assert len(chunks) == N
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, N + 1))
    assert all(plain["output_ids"][:len(c["output_ids"])] == c["output_ids"] for c in chunks)
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (N - 1)
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["meta_info"]["finish_reason"] == {
        "type": "length", "length": N}
    batch = _stream(ref_server, "/generate", {**body, "input_ids": [[5, 6, 7], [8, 9]], "stream": True})
    assert sorted(c["index"] for c in batch) == [0] * N + [1] * N


@pytest.mark.parametrize("version, metadata", [
    ("0.5.8", {"weight_version": "relabelled"}),  # 0.5.1-0.5.19: the version alone
    ("0.4.10.post2", None),  # before 0.5.1: no metadata
])
def test_older_dialects_answer_their_own_metadata(server_factory, version, metadata):
    server = server_factory(extra_args=["--protocol-version", version])
    if metadata is not None:
        server.client.update_weight_version("relabelled")
    for route, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})):
        r = _post(server, route, body)
        assert r.status_code == 200, r.text
        assert r.json().get("metadata") == metadata, (route, r.json())
        assert generation_versions(r.json()) == (
            [{"version": "relabelled", "start": 0, "end": r.json()["usage"]["completion_tokens"]}] if metadata else [])


def test_a_tokenizer_without_a_chat_template_is_answered_400(server_factory, tmp_path):
    path = make_model_dir(tmp_path / "no-template")
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    server = server_factory(model=path)
    try:
        r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["object"] == "error" and "chat template" in r.json()["message"]
        assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        server.stop()
        shutil.rmtree(path, ignore_errors=True)
