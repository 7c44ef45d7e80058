"""SGLang's OpenAI-compatible routes: ``/v1/completions`` and ``/v1/chat/completions``.

Both run the same generation as ``/generate`` and answer SGLang's response shapes (``entrypoints/openai/protocol.py``),
with ``metadata`` as SGLang builds it: ``{"weight_version"}`` from 0.5.1, and from 0.5.20 also ``weight_versions``
(``build_endpoint_weight_version_metadata``: the first choice's ``meta_info``), none before 0.5.1. A chat prompt is
the served tokenizer's chat template rendered with ``add_generation_prompt``; a tokenizer without one is answered
400 with transformers' own message, as SGLang's route answers it. Refusals take OpenAI's error shape
(``{"object": "error", "message", "type", "param", "code"}``, :mod:`inference_adapter.server`).

With ``"stream": true`` (:func:`_stream`) the chunks are sent as the tokens come, shaped as SGLang 0.5.23's
``serving_completions``/``serving_chat`` stream them: ``/v1/completions`` one chunk per token (its text delta,
possibly empty), the last one carrying ``finish_reason``; ``/v1/chat/completions`` a first chunk with the role, one
per non-empty delta, then one with ``finish_reason`` per choice; then ``usage`` when
``stream_options.include_usage``, then ``data: [DONE]``; with ``return_token_ids`` a completion chunk carries its
new ``token_ids`` (and the first one ``prompt_token_ids``). Like SGLang's, no streamed chunk carries ``metadata``
(SGLang builds it for the non-streamed answer only); streamed logprobs are refused (400).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from bridge.protocol import SamplingParams, describe_validation_error
from inference_adapter.errors import RequestError
from inference_adapter.model_state import ModelState
from inference_adapter.routes.common import Served, parse

__all__ = ["router"]

router = APIRouter()


class _Common(BaseModel):
    """The request fields both routes share (SGLang's ``CompletionRequest``/``ChatCompletionRequest``); others are
    ignored, as SGLang's own request models ignore unknown ones."""

    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    rid: str | None = None
    lora_path: str | None = None


class CompletionReq(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool = False


class ChatCompletionReq(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    logprobs: bool = False


def _sampling(req: _Common, max_new: int) -> SamplingParams:
    sp = {"max_new_tokens": max_new, "min_new_tokens": req.min_tokens, "stop": req.stop, "n": req.n,
          "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "sampling_seed": req.seed,
          "skip_special_tokens": req.skip_special_tokens}
    for key in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty"):
        if getattr(req, key) is not None:
            sp[key] = getattr(req, key)
    try:
        return SamplingParams.model_validate(sp)
    except ValidationError as e:
        raise RequestError(describe_validation_error("sampling parameters", e)) from None


def _adapter(state: ModelState, req: _Common):
    """The LoRA adapter the request asks for (SGLang's ``_resolve_lora_path``): ``model`` as ``base:adapter``
    (the served name itself may hold colons) before ``lora_path``; None for the base model."""
    model, name = req.model, None
    if ":" in model and model != state.served_model_name:
        prefix = f"{state.served_model_name}:"
        name = (model[len(prefix):] if model.startswith(prefix) else model.split(":", 1)[1]).strip() or None
    name = name if name is not None else req.lora_path
    return None if name is None else state.adapters.acquire(name)


def metadata(state: ModelState, meta: dict) -> dict | None:
    """SGLang's ``metadata`` of an OpenAI response from the first choice's ``meta_info``."""
    if not state.features.weight_version:
        return None
    out = {"weight_version": meta["weight_version"]}
    if state.features.weight_version_spans and "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    if "wsync_lora_version" in meta:  # the LoRA adapter's version (project field, inference_adapter.lora)
        out["wsync_lora_version"] = meta["wsync_lora_version"]
    return out


async def _generate(request: Request, state: ModelState, prompts: list[list[int]], sp: SamplingParams, logprob: bool,
                    req: _Common) -> list[dict]:
    limiter = request.app.state.generation_threads
    rid, adapter = req.rid, _adapter(state, req)
    rids = [rid] if rid is not None and len(prompts) == 1 else [None] * len(prompts)
    return list(await asyncio.gather(*[
        anyio.to_thread.run_sync(functools.partial(state.generate, p, sp, logprob, r, adapter=adapter), limiter=limiter)
        for p, r in zip(prompts, rids)]))


def _usage(outs: list[dict]) -> dict:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    done = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def _finish(meta: dict) -> tuple[str | None, Any]:
    f = meta["finish_reason"]
    return (f["type"], f.get("matched")) if f else (None, None)


def _no_streamed_logprobs(asked: bool) -> None:
    if asked:
        raise RequestError("logprobs with stream=true: the reference server does not stream logprobs; send "
                           "stream=false for them")


def _token_text(state: ModelState, tok: int) -> str:
    return state.tokenizer.decode([tok])


def _answer(state: ModelState, req: _Common, kind: str, outs: list[dict], choices: list[dict]) -> JSONResponse:
    """The non-streamed response of ``kind`` ``"text_completion"`` or ``"chat.completion"``, with ``metadata``."""
    body = {"id": outs[0]["meta_info"]["id"], "object": kind, "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": _usage(outs)}
    if (md := metadata(state, outs[0]["meta_info"])) is not None:
        body["metadata"] = md
    return JSONResponse(body)


def _completion_chunk(rid: str, created: int, req: _Common, index: int, text: str, finish: dict | None,
                      ids: list[int] | None = None, prompt_ids: list[int] | None = None) -> dict:
    """SGLang's ``CompletionStreamResponse``; ``ids``/``prompt_ids``: ``token_ids``/``prompt_token_ids`` (with
    ``return_token_ids``: this chunk's new output tokens, and the prompt's on the first chunk)."""
    f, m = _finish({"finish_reason": finish})
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": f, "matched_stop": m,
                         "hidden_states": None, "token_ids": ids, "prompt_token_ids": prompt_ids}],
            "usage": None, "sglext": None}


def _chat_chunk(rid: str, created: int, req: _Common, index: int, delta: dict, finish: dict | None = None) -> dict:
    f, m = _finish({"finish_reason": finish})
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
            "choices": [{"index": index, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                         "finish_reason": f, "matched_stop": m}]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _stream(request: Request, state: ModelState, req: _Common, kind: str, prompts: list[list[int]], sp: SamplingParams,
            prefixes: list[str]) -> StreamingResponse:
    """The event stream of ``kind`` (see the module docstring): every prompt generates on its own thread, whose
    ``watch`` hands each token's sendable text to this loop; ``prefixes``: text sent before the first delta (echo)."""
    for p in prompts:
        state.check_sampling(p, sp)  # refused before the stream starts, as SGLang validates before it streams
    adapter = _adapter(state, req)
    loop, q = asyncio.get_running_loop(), asyncio.Queue()
    base = req.rid if req.rid is not None and len(prompts) == 1 else None
    rids = [base or uuid.uuid4().hex for _ in prompts]
    limiter = request.app.state.generation_threads

    async def run(i: int) -> None:
        def watch(text: str, finished: bool, tok: int) -> None:
            if not finished:  # the finishing token is sent with the result
                loop.call_soon_threadsafe(q.put_nowait, (i, text, [tok], None))
        try:
            out = await anyio.to_thread.run_sync(functools.partial(state.generate, prompts[i], sp, False, rids[i],
                                                                   watch=watch, adapter=adapter), limiter=limiter)
        except Exception as e:
            out = e
        q.put_nowait((i, None, None, out))

    tasks = [asyncio.create_task(run(i)) for i in range(len(prompts))]
    chat = kind == "chat.completion"

    async def events():
        created, n = int(time.time()), len(prompts)
        sent, outs, finished, ids = [None] * n, [None] * n, 0, [[] for _ in prompts]
        want_ids = getattr(req, "return_token_ids", False)
        try:
            while finished < n:
                i, text, toks, out = await q.get()
                if isinstance(out, Exception):
                    yield _sse({"object": "error", "message": str(out), "type": "BadRequestError", "param": None,
                                "code": 400})
                    break
                if out is not None:
                    outs[i], finished, text = out, finished + 1, out["text"]
                    toks = out["output_ids"][len(ids[i]):]  # the finishing token (none after an abort)
                ids[i] += toks
                first, sent_now = sent[i] is None, prefixes[i] if sent[i] is None else sent[i]
                text = prefixes[i] + text
                delta = text[len(sent_now):] if text.startswith(sent_now) else ""
                sent[i] = sent_now + delta
                if first and chat:
                    yield _sse(_chat_chunk(rids[i], created, req, i, {"role": "assistant", "content": ""}))
                finish = out["meta_info"]["finish_reason"] if out is not None else None
                if not chat:
                    yield _sse(_completion_chunk(rids[i], created, req, i, delta, finish, toks if want_ids else None,
                                                 prompts[i] if want_ids and first else None))
                elif delta:
                    yield _sse(_chat_chunk(rids[i], created, req, i, {"content": delta}))
            else:
                for i, out in enumerate(outs if chat else []):
                    yield _sse(_chat_chunk(rids[i], created, req, i, {}, out["meta_info"]["finish_reason"]))
                if (req.stream_options or {}).get("include_usage"):
                    usage = _usage(outs)
                    tail = {"id": rids[0], "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": req.model, "choices": [], "usage": usage}
                    if chat:
                        tail["sglext"] = None
                    else:  # SGLang dumps this one without its null fields
                        tail["usage"] = {k: v for k, v in usage.items() if v is not None}
                    yield _sse(tail)
            yield "data: [DONE]\n\n"
        finally:  # a client that went away: its generations end
            for i, t in enumerate(tasks):
                if not t.done():
                    state.abort_request(rids[i], False)

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(request: Request, state: Served):
    req = await parse(request, CompletionReq)
    p = req.prompt
    if isinstance(p, str):
        texts, prompts = [p], [state.tokenizer(p)["input_ids"]]
    elif p and all(isinstance(x, str) for x in p):
        texts, prompts = list(p), [state.tokenizer(x)["input_ids"] for x in p]
    elif p and all(isinstance(x, list) for x in p):
        texts, prompts = None, [list(x) for x in p]
    else:
        texts, prompts = None, [list(p)]
    if req.echo and req.logprobs:
        raise RequestError("/v1/completions: echo with logprobs needs the prompt's logprobs, which the reference "
                           "server does not compute; send echo or logprobs")
    sp = _sampling(req, req.max_tokens)
    if req.stream:
        _no_streamed_logprobs(req.logprobs is not None)
        echo = [state.tokenizer.decode(x) if texts is None else texts[i] for i, x in enumerate(prompts)]
        return _stream(request, state, req, "text_completion", prompts, sp, echo if req.echo else [""] * len(prompts))
    outs = await _generate(request, state, prompts, sp, req.logprobs is not None, req)
    if texts is None:  # token ids, checked by the generation
        texts = [state.tokenizer.decode(x) for x in prompts]
    choices = []
    for i, o in enumerate(outs):
        finish, matched = _finish(o["meta_info"])
        logprobs = None
        if req.logprobs is not None:
            lps = o["meta_info"].get("output_token_logprobs", [])
            logprobs = {"text_offset": [-1] * len(lps), "token_logprobs": [lp for lp, _, _ in lps],
                        "tokens": [_token_text(state, t) for _, t, _ in lps], "top_logprobs": []}
        choices.append({"index": i, "text": (texts[i] if req.echo else "") + o["text"], "logprobs": logprobs,
                        "finish_reason": finish, "matched_stop": matched})
    return _answer(state, req, "text_completion", outs, choices)


def _chat_prompt(state: ModelState, messages: list[dict]) -> list[int]:
    msgs = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                              and part.get("type") == "text")
        msgs.append({**m, "content": content})
    if getattr(state.tokenizer, "chat_template", None) is None:
        # What SGLang answers for such a tokenizer: transformers' ValueError, as a 400.
        raise RequestError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                           "template argument was passed! The served tokenizer has no chat template; serve a model "
                           "whose tokenizer has one, or use /v1/completions or /generate")
    try:
        text = state.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template refused these messages (jinja2's raise_exception, a missing field)
        raise RequestError(f"/v1/chat/completions: the chat template failed on these messages: {e}") from None
    ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RequestError("/v1/chat/completions: the chat template rendered these messages as an empty prompt")
    return ids


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: Served):
    req = await parse(request, ChatCompletionReq)
    if not req.messages:
        raise RequestError("/v1/chat/completions: 'messages' is empty; send at least one message")
    prompt = _chat_prompt(state, req.messages)
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sp = _sampling(req, limit if limit is not None else max(0, state.context_length - len(prompt)))
    if req.stream:
        _no_streamed_logprobs(req.logprobs)
        return _stream(request, state, req, "chat.completion", [prompt], sp, [""])
    outs = await _generate(request, state, [prompt], sp, req.logprobs, req)
    choices = []
    for i, o in enumerate(outs):
        finish, matched = _finish(o["meta_info"])
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [{"token": (tt := _token_text(state, t)), "bytes": list(tt.encode()),
                                     "logprob": lp, "top_logprobs": []}
                                    for lp, t, _ in o["meta_info"].get("output_token_logprobs", [])]}
        choices.append({"index": i, "message": {"role": "assistant", "content": o["text"], "reasoning_content": None},
                        "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched})
    return _answer(state, req, "chat.completion", outs, choices)

