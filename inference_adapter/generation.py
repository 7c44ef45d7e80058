"""Generation on the served model: greedy/sampling decode, stop handling, and pause/abort/retract.

Every generation holds the reader side of the weights lock while it computes and records
``(weights epoch, version)`` when it starts, so each step sees the old weights or the new ones, never a mix;
a generation's tokens span two weights only where the dialect reports it (below).

Pause: ``abort`` ends in-flight generations with ``finish_reason`` abort; ``retract`` and
``in_place`` park them at the next token, outside the lock; after ``/continue_generation`` a parked
generation continues, or starts again from its prompt if the weights changed meanwhile (no mixed
outputs; ``meta_info.num_retractions`` counts restarts). New generations wait while paused.

Weight versions (SGLang 0.5.20+, ``ProtocolFeatures.weight_version_spans``): whenever the version label changes
(a swap with a version, ``/update_weight_version``) each generation in flight that has output tokens records
``(old version, tokens so far)``, as SGLang's scheduler does (``record_weight_version_events``); a finished
generation reports ``meta_info.weight_versions``, the spans of its tokens under each version, and
``weight_version``, the version it finished on (:func:`weight_version_spans`, :func:`add_weight_versions`: SGLang
0.5.23's ``compute_weight_version_spans`` and ``add_weight_versions_to_meta_info``). There a generation parked
``in_place`` across a swap keeps its tokens and continues on the new weights, its prefix (prompt and tokens so
far) computed again by them; older dialects start it again from its prompt, and report the version it started
on.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bridge.protocol import WAITING_FOR_WEIGHTS, SamplingParams
from inference_adapter.errors import RequestError
from inference_adapter.lora import using

__all__ = ["GenerationMixin", "add_weight_versions", "weight_version_spans"]


def weight_version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """The spans ``[{"version", "start", "end"}, ...]`` of ``n`` output tokens, from the ``(old version, tokens
    then)`` recorded at each version change and the ``current`` version (SGLang's ``compute_weight_version_spans``)."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def add_weight_versions(meta: dict, spans: list[dict], n: int) -> None:
    """``meta_info``'s ``weight_versions`` and ``weight_version`` (SGLang's ``add_weight_versions_to_meta_info``)."""
    visible = [sp for sp in spans if sp["start"] < n or sp["start"] == 0]
    meta["weight_versions"] = [{"version": sp["version"], "start": sp["start"], "end": min(sp["end"], n)}
                               for sp in visible]
    meta["weight_version"] = visible[-1]["version"]


ABORTED = "Aborted"
"""The message of an aborted generation's ``finish_reason``, as SGLang's ``FINISH_ABORT`` writes it."""

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's ``GPU_MEMORY_ALL_TYPES``: what an empty ``tags`` releases or resumes."""


@dataclass(eq=False)
class _Gen:
    """One generation in flight."""

    rid: str
    state: str = "waiting"  # waiting | running | parked
    abort: str | None = None  # the abort message once aborted
    abort_version: str | None = None  # the version served when it was aborted
    mode: str | None = None  # the pause mode it was last parked under
    decode: _Decode | None = None
    watch: Callable[[str, bool, int], None] | None = None  # a stream's reader: (sendable text, finished, token)


class GenerationMixin:
    """:class:`~inference_adapter.model_state.ModelState`'s generation and pause/abort methods.

    Uses the host's ``model``, ``tokenizer``, ``context_length``, ``eos_token_ids``, ``cache_kw``, ``log`` and
    ``weights`` (:class:`~inference_adapter.weights.ServedWeights`: its reader lock, epoch and version); owns
    the pause state (``_cv``, ``_paused``, ``_pause_mode``, ``_gens``), set up by :meth:`_init_generation`.
    """

    def _init_generation(self) -> None:
        self._cv = threading.Condition()  # guards _paused, _gens
        self.waiting_for_weights = False  # (ModelState: --wait-for-weights)
        self._paused = False
        self._pause_mode = "abort"
        self._gens: set[_Gen] = set()
        self._released: set[str] = set()  # memory tags released (/release_memory_occupation), not yet resumed
        self._served = dict(requests=0, aborted=0, prompt_tokens=0, generation_tokens=0)  # since start (/metrics)

    def generate(self, prompt: list[int], sp: SamplingParams, return_logprob: bool, rid: str | None = None,
                 watch: Callable[[str, bool, int], None] | None = None, adapter=None) -> dict:
        """Decode one prompt; SGLang's result shape ``{"text", "output_ids", "meta_info"}``.

        ``adapter`` (an :class:`inference_adapter.lora.Adapter`, taken when the request came): every forward of
        this generation runs with it, and ``meta_info.wsync_lora_version`` reports its version.

        ``watch`` (a streamed answer): called on the generating thread after each token with the text so far
        that may be sent (:meth:`_Decode.sendable`), whether that token finished the generation, and the token; such a generation keeps its tokens across a weight change
        under any pause mode, as SGLang's do, since what it sent cannot be taken back.
        """
        with using(adapter):
            out = self._generate(prompt, sp, return_logprob, rid, watch)
        if adapter is not None:
            out["meta_info"]["wsync_lora_version"] = adapter.version
        return out

    def _generate(self, prompt: list[int], sp: SamplingParams, return_logprob: bool, rid: str | None,
                  watch: Callable[[str, bool, int], None] | None) -> dict:
        t0 = time.perf_counter()
        self.check_sampling(prompt, sp)
        max_new = min(sp.max_new_tokens, self.context_length - len(prompt))
        gen = _Gen(rid or uuid.uuid4().hex, watch=watch)
        with self._cv:
            self._gens.add(gen)
        st = None
        restarts = 0
        try:
            while True:
                with self._cv:
                    while (self._paused or self._released) and gen.abort is None:
                        gen.state = "parked" if st is not None else "waiting"
                        gen.mode = self._pause_mode
                        self._cv.wait()
                if gen.abort is not None:
                    break
                self.weights.rw.acquire_read()
                try:
                    with self._cv:
                        gen.state = "running"
                    if st is not None and st.epoch != self.weights.epoch and st.out and (gen.watch is not None or (
                            gen.mode == "in_place" and self.features.weight_version_spans)):
                        st.continue_on_new_weights()
                    elif st is None or st.epoch != self.weights.epoch:
                        restarts += st is not None
                        st = gen.decode = _Decode(self, prompt, sp, max_new, return_logprob)
                    st.run(gen, lambda: self._paused)
                finally:
                    with self._cv:
                        gen.state = "parked"
                        self._cv.notify_all()
                    self.weights.rw.release_read()
                if st.finish is not None or gen.abort is not None:
                    break
        finally:
            with self._cv:
                self._gens.discard(gen)
                self._cv.notify_all()
        if st is None:  # aborted before it started
            st = _Decode.empty(self, prompt, max_new)
        if st.finish is None:
            st.finish = {"type": "abort", "message": gen.abort, "status_code": None, "err_type": None}
            st.final_version = gen.abort_version or self.weights.version
        with self._cv:
            served = self._served
            served["requests"] += 1
            served["aborted"] += st.finish["type"] == "abort"
            served["prompt_tokens"] += len(prompt)
            served["generation_tokens"] += len(st.out)
        return st.result(gen.rid, restarts, time.perf_counter() - t0)

    def request_counts(self) -> dict[str, int]:
        """For ``/metrics``: generations ``running`` now (started, parked by a pause or not) and ``waiting`` to
        start, and since the start the ``requests`` that ended, those ``aborted``, their ``prompt_tokens`` and
        ``generation_tokens``."""
        with self._cv:
            running = sum(1 for g in self._gens if g.state != "waiting")
            return dict(self._served, running=running, waiting=len(self._gens) - running)

    def _record_version_change(self, old: str, new: str) -> None:
        """The version label changed from ``old`` (under the weights' writer lock: nothing computes): every
        generation in flight with output tokens records how many it had (SGLang's ``record_weight_version_events``)."""
        with self._cv:
            for g in self._gens:
                if g.abort is None and g.decode is not None and g.decode.out:
                    g.decode.events.append((old, len(g.decode.out)))

    def check_sampling(self, prompt: list[int], sp: SamplingParams) -> None:
        """Refuse a generation before it starts (the routes call it before a stream begins): the server waits for its
        first weights (``--wait-for-weights``), or the prompt or sampling parameters are out of range."""
        if self.waiting_for_weights:
            raise RequestError(f"this server waits for the fleet's weights (--wait-for-weights) and serves its base "
                               f"weights, version {self.weights.version}, which it does not answer from; a publish or "
                               "`wsync watch` gives it a version", status=503, reason=WAITING_FOR_WEIGHTS)
        vocab = self.model.config.vocab_size
        if not prompt:
            raise RequestError("the prompt is empty; send non-empty text or input_ids")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids contain {bad[:5]}, outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.context_length:
            raise RequestError(f"the prompt has {len(prompt)} tokens; the model's context length is {self.context_length}")
        checks = [
            (sp.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (sp.temperature >= 0, "temperature must be >= 0"),
            (0 < sp.top_p <= 1, "top_p must be in (0, 1]"),
            (sp.top_k == -1 or sp.top_k >= 1, "top_k must be -1 (all) or >= 1"),
            (0 <= sp.min_p <= 1, "min_p must be in [0, 1]"),
            (sp.n == 1, "the reference server supports n=1 only; send the prompt several times"),
            (sp.frequency_penalty == 0 and sp.presence_penalty == 0 and sp.repetition_penalty == 1,
             "the reference server does not implement frequency/presence/repetition penalties; leave them at 0, 0, 1"),
            (all(0 <= t < vocab for t in sp.stop_token_ids or ()),
             f"stop_token_ids must be token ids in [0, {vocab}), the model's vocabulary"),
        ]
        checks += [(seed is None or 0 <= seed < 1 << 64, f"{name} must be in [0, 2**64), the range of a torch seed")
                   for name, seed in (("sampling_seed", sp.sampling_seed), ("seed", sp.seed))]
        for ok, msg in checks:
            if not ok:
                raise RequestError(f"sampling_params: {msg}")

    # ------------------------------------------------------------------ pause / abort

    def pause(self, mode: str) -> None:
        """Stop generating; returns when no generation holds the weights (abort: when they have ended)."""
        with self._cv:
            self._paused, self._pause_mode = True, mode
            victims = set(self._gens) if mode == "abort" else set()
            for g in victims:
                self._abort(g, "Abort by pause_generation.")
            self._cv.notify_all()
            while any(g.state == "running" for g in self._gens) or (victims & self._gens):
                self._cv.wait(timeout=1.0)
        self.log.info("generation paused (mode %s)", mode)

    def pause_if_idle(self, mode: str) -> bool:
        """Pause at once when no generation is under way (no wait, so the route need not leave the event
        loop for a thread: that hand-off was most of an idle pause); False when :meth:`pause` must wait."""
        with self._cv:
            if self._gens:
                return False
            self._paused, self._pause_mode = True, mode
        self.log.info("generation paused (mode %s)", mode)
        return True

    def is_paused(self) -> bool:
        with self._cv:
            return self._paused

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()
        self.log.info("generation continued")

    def abort_all(self, why: str) -> int:
        with self._cv:
            for g in self._gens:
                self._abort(g, why)
            self._cv.notify_all()
            return len(self._gens)

    def abort_request(self, rid: str | None, abort_all: bool) -> int:
        """SGLang's ``/abort_request``: every generation (``abort_all``), or those whose rid starts with a ``rid``
        in flight (SGLang's tokenizer side sends only a rid it knows; its scheduler matches the prefix); an empty
        or unknown rid aborts nothing. Returns how many were aborted."""
        with self._cv:
            if abort_all:
                victims = set(self._gens)
            elif rid and any(g.rid == rid for g in self._gens):
                victims = {g for g in self._gens if g.rid.startswith(rid)}
            else:
                victims = set()
            for g in victims:
                self._abort(g, "Abort by abort_request.")
            self._cv.notify_all()
            return len(victims)

    def release_memory(self, tags: list[str] | None) -> None:
        """SGLang's ``/release_memory_occupation``: only when idle (SGLang asserts it, and its scheduler dies of a
        failed assert; here a 400), where generations waiting out a pause that is not ``in_place`` count as idle, as
        SGLang's ``ignore_waiting`` while paused. Until every released tag is resumed, generations wait."""
        with self._cv:
            busy = [g for g in self._gens if g.state == "running" or not self._paused
                    or (self._pause_mode == "in_place" and g.state == "parked")]
            if busy:
                raise RequestError(f"release_memory_occupation should be called only when server is idle: {len(busy)} "
                                   "requests are running; pause generation (not in_place) or let them finish first")
            self._released |= set(tags or MEMORY_TAGS)
        self.log.info("memory released (tags %s)", sorted(self._released))

    def resume_memory(self, tags: list[str] | None) -> None:
        """SGLang's ``/resume_memory_occupation``; a tag that is not released is refused (SGLang's scheduler dies
        of it, removing it from its set of released tags)."""
        tags = list(tags or MEMORY_TAGS)
        with self._cv:
            missing = [t for t in tags if t not in self._released]
            if missing:
                raise RequestError(f"resume_memory_occupation: {missing} not released (released: "
                                   f"{sorted(self._released)}); release a tag before resuming it")
            self._released -= set(tags)
            self._cv.notify_all()
        self.log.info("memory resumed (tags %s)", tags)

    def released_memory(self) -> list[str]:
        with self._cv:
            return sorted(self._released)

    def _abort(self, g: _Gen, why: str) -> None:
        """Caller holds ``_cv``. The generation ends with SGLang's message, ``Aborted`` (its ``FINISH_ABORT``'s in
        every release, whatever aborted it: the real server's answer); ``why`` goes to this server's log."""
        if g.abort is None:
            g.abort, g.abort_version = ABORTED, self.weights.version
            self.log.debug("request %s aborted: %s", g.rid, why)


class _Decode:
    """The decoding state of one generation under one weights epoch; ``run`` continues it."""

    def __init__(self, state: GenerationMixin, prompt: list[int], sp: SamplingParams, max_new: int, logprob: bool):
        from transformers import DynamicCache

        self.s, self.prompt, self.sp, self.max_new, self.want_logprob = state, prompt, sp, max_new, logprob
        self.epoch, self.version = state.weights.epoch, state.weights.version
        self.greedy = sp.temperature < 1e-6 or sp.top_k == 1
        seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
        self.gen = torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(7), "little"))
        self.cache = DynamicCache(config=state.model.config)
        self.cached = 0  # tokens of prompt + out the cache holds
        self.events: list[tuple[str, int]] = []  # (old version, output tokens then) at each version change
        self.final_version = self.version
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict | None = None
        self.stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        self.stop_ids = [] if sp.ignore_eos else list(dict.fromkeys([*(sp.stop_token_ids or []), *state.eos_token_ids]))
        self.text_cut: int | None = None

    @classmethod
    def empty(cls, state: GenerationMixin, prompt: list[int], max_new: int) -> _Decode:
        d = cls.__new__(cls)
        d.s, d.prompt, d.out, d.logprobs, d.finish, d.version = state, prompt, [], [], None, state.weights.version
        d.want_logprob, d.text_cut, d.sp, d.events, d.final_version = False, None, SamplingParams(), [], d.version
        return d

    def continue_on_new_weights(self) -> None:
        """Keep the tokens so far and go on under the weights now served (caller holds the reader lock): the
        prefix, prompt and output, is computed again by them at the next step."""
        from transformers import DynamicCache

        self.epoch, self.version = self.s.weights.epoch, self.s.weights.version
        self.cache, self.cached = DynamicCache(config=self.s.model.config), 0

    @torch.no_grad()
    def run(self, gen: _Gen, paused) -> None:
        model = self.s.model
        if self.max_new <= 0:
            self.finish = {"type": "length", "length": self.sp.max_new_tokens}
            return
        while self.finish is None:
            if gen.abort is not None or paused():
                return
            start = self.cached
            ids = (self.prompt + self.out)[start:]
            # Same calls as transformers' greedy generate (prefill, then one token with the cache),
            # so greedy outputs are identical to model.generate(do_sample=False).
            o = model(input_ids=torch.tensor([ids]), use_cache=True, **{self.s.cache_kw: self.cache},
                      cache_position=torch.arange(start, start + len(ids)), logits_to_keep=1)
            self.cached = start + len(ids)
            logits = o.logits[0, -1].float()
            if len(self.out) < self.sp.min_new_tokens and self.stop_ids:
                logits[self.stop_ids] = -math.inf
            tok, lp = self._pick(logits)
            self.out.append(tok)
            if self.want_logprob:
                self.logprobs.append(lp)
            self._check_finish(tok)
            if gen.watch is not None:
                gen.watch(self.sendable(), self.finish is not None, tok)
        self.final_version = self.s.weights.version  # (under the reader lock: no relabel meanwhile)

    def _pick(self, logits: torch.Tensor) -> tuple[int, float]:
        if self.greedy:
            tok = int(torch.argmax(logits))
            return tok, float(torch.log_softmax(logits, -1)[tok]) if self.want_logprob else 0.0
        sp = self.sp
        scaled = logits / sp.temperature
        probs = torch.softmax(scaled, -1)
        if sp.top_k > 0 and sp.top_k < probs.numel():
            kth = torch.topk(probs, sp.top_k).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, -1)
            sorted_p[(cum - sorted_p) > sp.top_p * cum[-1]] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        if sp.min_p > 0:
            probs = torch.where(probs < sp.min_p * probs.max(), 0.0, probs)
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
        return tok, float(torch.log_softmax(scaled, -1)[tok]) if self.want_logprob else 0.0

    def _check_finish(self, tok: int) -> None:
        if tok in self.stop_ids:  # (masked out before min_new_tokens)
            self.finish = {"type": "stop", "matched": tok}
            return
        if self.stops:
            text = self._decode()
            hits = [(text.find(s), s) for s in self.stops if s and s in text]
            if hits:
                at, s = min(hits)
                self.text_cut = at
                self.finish = {"type": "stop", "matched": s}
                return
        if len(self.out) >= self.max_new:
            self.finish = {"type": "length", "length": self.sp.max_new_tokens}

    def _decode(self) -> str:
        return self.s.tokenizer.decode(self.out, skip_special_tokens=self.sp.skip_special_tokens)

    def sendable(self) -> str:
        """The text so far that a stream may send: all of it once finished (cut at a matched stop string);
        before, without a trailing incomplete character (U+FFFD, as SGLang's detokenizer holds it back) and
        without the characters a stop string could still begin with."""
        text = self._decode() if self.out else ""
        if self.finish is not None:
            return text if self.text_cut is None else text[: self.text_cut]
        text = text.rstrip("\ufffd")
        hold = max((len(s) - 1 for s in self.stops if s), default=0)
        return text[: len(text) - hold] if hold else text

    def result(self, rid: str, restarts: int, seconds: float) -> dict:
        text = self._decode() if self.out else ""
        if self.text_cut is not None:
            text = text[: self.text_cut]
        meta = {
            "id": rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.out),
            "cached_tokens": 0,
            "weight_version": self.version,
            "num_retractions": restarts,
            "e2e_latency": seconds,
        }
        if self.s.features.weight_version_spans:
            add_weight_versions(meta, weight_version_spans(self.events, self.final_version, len(self.out)), len(self.out))
        if self.want_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.out)]
        return {"text": text, "output_ids": list(self.out), "meta_info": meta}
