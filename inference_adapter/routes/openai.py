"""SGLang's OpenAI-compatible routes: ``/v1/completions`` and ``/v1/chat/completions``.

Both run the same generation as ``/generate`` and answer SGLang's response shapes (``entrypoints/openai/protocol.py``),
with ``metadata`` as SGLang builds it: ``{"weight_version"}`` from 0.5.1, and from 0.5.20 also ``weight_versions``
(``build_endpoint_weight_version_metadata``: the first choice's ``meta_info``), none before 0.5.1. A chat prompt is
the served tokenizer's chat template rendered with ``add_generation_prompt``; a tokenizer without one is answered
400 with transformers' own message, as SGLang's route answers it. Refusals take OpenAI's error shape
(``{"object": "error", "message", "type", "param", "code"}``, :mod:`inference_adapter.server`). With
``"stream": true`` the answer is a server-sent stream of one chunk with the whole text, one with the finish reason
(and ``usage`` when ``stream_options.include_usage``), then ``[DONE]``: the reference server generates before it
answers.
"""

from __future__ import annotations

import asyncio
import json
import time
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


class CompletionReq(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    echo: bool = False


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


def metadata(state: ModelState, meta: dict) -> dict | None:
    """SGLang's ``metadata`` of an OpenAI response from the first choice's ``meta_info``."""
    if not state.features.weight_version:
        return None
    out = {"weight_version": meta["weight_version"]}
    if state.features.weight_version_spans and "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


async def _generate(request: Request, state: ModelState, prompts: list[list[int]], sp: SamplingParams, logprob: bool,
                    rid: str | None) -> list[dict]:
    limiter = request.app.state.generation_threads
    rids = [rid] if rid is not None and len(prompts) == 1 else [None] * len(prompts)
    return list(await asyncio.gather(*[anyio.to_thread.run_sync(state.generate, p, sp, logprob, r, limiter=limiter)
                                       for p, r in zip(prompts, rids)]))


def _usage(outs: list[dict]) -> dict:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    done = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def _finish(meta: dict) -> tuple[str | None, Any]:
    f = meta["finish_reason"]
    return (f["type"], f.get("matched")) if f else (None, None)


def _token_text(state: ModelState, tok: int) -> str:
    return state.tokenizer.decode([tok])


def _answer(state: ModelState, req: _Common, kind: str, outs: list[dict], choices: list[dict]):
    """The response (or, with ``stream``, the event stream) of ``kind`` ``"text_completion"`` or ``"chat.completion"``."""
    rid = outs[0]["meta_info"]["id"]
    created = int(time.time())
    if not req.stream:
        body = {"id": rid, "object": kind, "created": created, "model": req.model, "choices": choices,
                "usage": _usage(outs)}
        if (md := metadata(state, outs[0]["meta_info"])) is not None:
            body["metadata"] = md
        return JSONResponse(body)
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

    def chunk(choice: dict, usage: dict | None = None) -> str:
        return "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created, "model": req.model,
                                      "choices": [choice], "usage": usage}) + "\n\n"

    def events():
        for c in choices:
            head = {k: v for k, v in c.items() if k not in ("finish_reason", "matched_stop")}
            if kind == "chat.completion":
                head = {"index": c["index"], "delta": c["message"], "logprobs": c["logprobs"]}
            yield chunk({**head, "finish_reason": None, "matched_stop": None})
            tail = {"index": c["index"], "finish_reason": c["finish_reason"], "matched_stop": c["matched_stop"]}
            yield chunk({**tail, **({"delta": {}} if kind == "chat.completion" else {"text": ""})})
        if (req.stream_options or {}).get("include_usage"):
            yield "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created, "model": req.model,
                                         "choices": [], "usage": _usage(outs)}) + "\n\n"
        yield "data: [DONE]\n\n"

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
    outs = await _generate(request, state, prompts, sp, req.logprobs is not None, req.rid)
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
    outs = await _generate(request, state, [prompt], sp, req.logprobs, req.rid)
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

