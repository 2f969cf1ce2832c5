"""The serving engine: requests in, batched forwards over the AKV cache, tokens out.

`submit` renders and validates a request on the caller's thread and queues it;
`step` (on one loop thread, or driven by `generate`) admits waiting requests,
runs ONE forward over a chunk of prompt tokens (at most `prefill_chunk`, shared by
the requests still prefilling) plus one decode token for every running request,
samples, streams, and finishes requests (eos, stop strings, max_tokens, context
length). A long prompt is thus computed over several steps between which the
other requests decode and cancellations take effect. Cache bookkeeping lives in
`akv_core.cache`; this file only does the tensor work its plans ask for.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from akv_core.attribution import Attribution, KeyProvenance
from akv_core.cache.allocator import SlotAllocator
from akv_core.cache.key import build_key
from akv_core.cache.kv_cache import KVCache, KVCapacityError
from akv_core.cache.layout import Rerotations, Stage
from akv_core.cache.ops import Operations, validate_operations
from akv_core.cache.planner import plan_request
from akv_core.cache.radix import RadixCache
from akv_core.cache.text_drop import TextDrop
from akv_core.cache.usage import Usage
from akv_core.chat import ChatTokenizer, Rendered
from akv_core.constrain import Constrainer, Grammar
from akv_core.continuation import (ContextLengthExceeded, ContinuationScore, split_final_message,
                                   text_drop_before_reply)
from akv_core.forcing import ForcedResult, ForcedRows, fold_scratch, forced_pass, reply_attribution, visible_offsets
from akv_core.model.batch import ForwardBatch, MassProbe, SeqAttention
from akv_core.request import (DEFAULT_MAX_TOKENS, ERROR_ENGINE, FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH,
                              FINISH_STOP, Generation, Request, RequestEvent, RequestHandle, SamplingParams,
                              StreamText)
from akv_core.sampling import (TOP_LOGPROBS_MAX, TokenLogprob, check_sampling, check_top_logprobs, generator_for,
                               log_probs, sample, token_logprob)
from akv_core.scheduler import Scheduler
from akv_core.threads import METER, kernel_threads, phase_threads, torch_threads

_log = logging.getLogger(__name__)

# Prompt tokens computed per step, over all requests (measured: docs/benchmarks.md, "Chunked prefill").
DEFAULT_PREFILL_CHUNK = 512
# At least this many slots on the CPU; the default is 4 contexts' worth, since a full prompt,
# its re-rotated copies after a reposition and the decode reservation must fit at once.
DEFAULT_CPU_KV_TOKENS = 16_384


@dataclass(eq=False)
class ScoredRequest(Request):
    """A request that asked for log probabilities (`submit(top_logprobs=k)`): every token event
    carries the sampled token's and the k most likely tokens'. Other requests compute none."""

    top_logprobs: int = 0


@dataclass(frozen=True)
class ScoredEvent(RequestEvent):
    """A token event of a ScoredRequest: `logprob` is the sampled token's entry."""

    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class EngineStats:
    kv_slots_total: int
    kv_slots_used: int
    kv_slots_free: int
    kv_slots_cached: int
    running: int
    waiting: int
    requests_finished: int
    prompt_tokens: int
    prefilled_tokens: int
    cached_tokens: int
    repos_tokens: int
    drop_skipped_tokens: int
    completion_tokens: int
    # Forward passes and their wall seconds: with prompt rows ("prefill", decode rows riding along
    # included) and decode-only.
    prefill_passes: int = 0
    decode_passes: int = 0
    prefill_pass_seconds: float = 0.0
    decode_pass_seconds: float = 0.0
    # Reused prompt tokens whose KV came back from retained (dropped or superseded) entries: a
    # subset of cached + repos + drop_skipped. Retained KV slots held now, and evicted so far.
    retained_tokens: int = 0
    kv_slots_retained: int = 0
    kv_slots_retained_evicted: int = 0


class Engine:
    """A model, its tokenizer, one KV pool with its radix cache, and the batching loop."""

    def __init__(self, model: Any, tokenizer: ChatTokenizer, kv_tokens: int, max_running: int = 8,
                 threads: Mapping[str, int] | None = None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK) -> None:
        """`prefill_chunk`: prompt tokens computed per step over all requests (None: whole stages)."""
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk: must be a positive number of tokens or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.model = model
        self.tokenizer = tokenizer
        self.kv = model.new_kv_buffers(kv_tokens)
        self.cache = KVCache(kv_tokens)
        self.scheduler = Scheduler(self.cache, max_running)
        self.context_length: int = model.config.context_length
        self._threads = dict(threads) if threads is not None else None   # None: akv_core.threads decides
        METER.busy_elsewhere()   # a first reading, so that the first steps judge the idle cores
        self._lock = threading.Lock()              # one step at a time; guards scheduler and cache
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._loop_running = False
        # Called with (handle, logits row) for every sampled token; tests compare logits through it.
        self.logits_probe: Callable[[RequestHandle, torch.Tensor], None] | None = None
        self.constrainer = Constrainer(tokenizer.to_json, model.config.vocab_size, tokenizer.eos_token_ids)
        self._totals = dict.fromkeys(("requests_finished", "prompt_tokens", "prefilled_tokens", "cached_tokens",
                                      "repos_tokens", "drop_skipped_tokens", "completion_tokens",
                                      "retained_tokens"), 0)
        self._passes = {"prefill": [0, 0.0], "decode": [0, 0.0]}   # phase -> [passes, wall seconds]

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", device: str = "auto", kv_tokens: int | None = None,
                        max_running: int = 8, precision: str = "float32",
                        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, context_length: int | None = None,
                        rope_scaling: str | None = None) -> Engine:
        """Load `smollm2`, a GGUF file or a safetensors folder onto `device` ("auto", "cpu" or "cuda").

        `precision` is the weights' (see `akv_core.model.loader.load_model`); "float32" is exact.
        `context_length` and `rope_scaling` serve it at a longer context with its RoPE scaled
        (`Engine.from_pretrained("smollm2", context_length=32768, rope_scaling="yarn")`: YaRN x4).
        """
        from akv_core.model.loader import load_model

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device: expected auto, cpu or cuda, got {device!r}")
        model = load_model(name_or_path, device=device, precision=precision, context_length=context_length,
                           rope_scaling=rope_scaling)
        if kv_tokens is None:
            kv_tokens = _default_kv_tokens(model, device)
        return cls(model, ChatTokenizer.from_model(name_or_path), kv_tokens, max_running,
                   prefill_chunk=prefill_chunk)

    # -- the client side -------------------------------------------------------------------------

    def submit(self, messages: Sequence[Mapping], drop_message: Mapping[Any, Any] | None = None,
               reposition: Sequence[Any] | None = None, tools: Sequence[Mapping] | None = None,
               max_tokens: int | None = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop: str | Sequence[str] | None = None, thinking_drop: bool = False,
               grammar: Grammar | None = None, text_drop: TextDrop | None = None,
               top_logprobs: int | None = None, *, attribution: bool = False,
               continue_final_message: bool = False, prompt_logprobs: int | None = None) -> RequestHandle:
        """Queue a request (thread-safe). Raises OperationError / ValueError / KVCapacityError for bad input.

        `max_tokens=None` means DEFAULT_MAX_TOKENS; that many decode slots are reserved at admission.
        `thinking_drop` hides each earlier message's reasoning from everything after that message
        (the API's `drop_rule: {"type": "thinking_drop"}`; not together with `drop_message`).
        `text_drop` hides parts of messages (a `text_drop` / `keep_text_drop` rule read by
        `akv_core.cache.text_drop`; `messages` is then the history it was read against).
        `grammar` constrains the output (`akv_core.constrain`); an invalid one raises GrammarError.
        `top_logprobs` (0 to 20; None, the default, computes none): each token event is a ScoredEvent
        with the sampled token's log probability and the `top_logprobs` most likely tokens'.
        `attribution`: the final event carries the reply's `Attribution` (`akv_core.attribution`),
        computed after the last token in one teacher-forced pass; decoding itself is unchanged.
        `continue_final_message`: `messages` ends with an assistant message that the reply continues;
        its tokens are fed in one pass, not generated (`akv_core.continuation`), and `max_tokens`
        counts the new tokens. Cache operations name history messages only. `prompt_logprobs` (0 to
        20, with `continue_final_message`): the final event's `continuation_scores` hold each of the
        message's tokens' log probability and rank, with that many most likely alternatives.
        """
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not messages:
            raise ValueError("messages: at least one message is required")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer of at least 1, got {max_tokens!r}")
        check_sampling(temperature, top_p, seed)
        check_top_logprobs(top_logprobs)
        _check_reply_options(attribution, continue_final_message, prompt_logprobs, grammar)
        history = len(messages) - 1 if continue_final_message else len(messages)
        if continue_final_message:
            text_drop = text_drop_before_reply(text_drop, history)
        operations = validate_operations(history, drop_message, reposition, thinking_drop, text_drop)
        if continue_final_message:
            split = split_final_message(self.tokenizer, messages, tools, closed=False)
            rendered, continuation = split.prompt, split.reply
        else:
            rendered, continuation = self.tokenizer.render(messages, tools), ()
        constraint = self.constrainer.start(grammar) if grammar is not None else None
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        params = SamplingParams(len(continuation) + max_tokens, temperature, top_p, seed, stops)
        request = self._request(rendered, operations, params, top_logprobs, f"messages[{history}]",
                                continuation=continuation, continuation_scored=prompt_logprobs is not None,
                                continuation_top=prompt_logprobs, constraint=constraint)
        if attribution:
            request.provenance = KeyProvenance(rendered.spans, rendered.header_start)
        return self._queue(request)

    def generate(self, messages: Sequence[Mapping], drop_message: Mapping[Any, Any] | None = None,
                 reposition: Sequence[Any] | None = None, tools: Sequence[Mapping] | None = None,
                 max_tokens: int | None = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, thinking_drop: bool = False,
                 grammar: Grammar | None = None, text_drop: TextDrop | None = None, *,
                 attribution: bool = False, continue_final_message: bool = False,
                 prompt_logprobs: int | None = None) -> Generation:
        """Run one request to the end (steps the engine itself unless a loop thread does)."""
        handle = self.submit(messages, drop_message, reposition, tools, max_tokens, temperature, top_p, seed, stop,
                             thinking_drop, grammar, text_drop, attribution=attribution,
                             continue_final_message=continue_final_message, prompt_logprobs=prompt_logprobs)
        return self._wait(handle)

    def score_continuation(self, messages: Sequence[Mapping], continuation: Mapping | str,
                           drop_message: Mapping[Any, Any] | None = None, reposition: Sequence[Any] | None = None,
                           tools: Sequence[Mapping] | None = None, thinking_drop: bool = False,
                           text_drop: TextDrop | None = None, attribution: bool = False) -> ContinuationScore:
        """The log-likelihood of a recorded assistant reply after `messages` under the cache operations.

        `continuation` is an assistant message (content, tool calls, reasoning) or its content; its
        tokens after the generation prompt, through the end-of-turn token, are scored in one
        teacher-forced pass against the KV the operations leave visible (reused from the cache as
        for any request with this history and these operations; only the reply is computed, and
        it is not kept). `attribution`: the reply's attention over the history as well.
        """
        reply = {"role": "assistant", "content": continuation} if isinstance(continuation, str) else dict(continuation)
        if reply.setdefault("role", "assistant") != "assistant":
            raise ValueError(f"continuation.role: must be assistant, got {reply['role']!r}")
        if not messages:
            raise ValueError("messages: at least one message is required")
        operations = validate_operations(len(messages), drop_message, reposition, thinking_drop, text_drop)
        split = split_final_message(self.tokenizer, [*messages, reply], tools, closed=True)
        if not split.reply:
            raise ValueError("continuation: renders no tokens to score")
        params = SamplingParams(len(split.reply), 0.0, 1.0, None, ())
        request = self._request(split.prompt, operations, params, None, "continuation",
                                continuation=split.reply, continuation_scored=True)
        if attribution:
            request.provenance = KeyProvenance(split.prompt.spans, split.prompt.header_start)
        done = self._wait(self._queue(request))
        logprobs = tuple(score.logprob for score in done.continuation_scores)
        return ContinuationScore(split.reply, logprobs, sum(logprobs), done.usage, done.attribution)

    def _request(self, rendered: Rendered, operations: Operations, params: SamplingParams,
                 top_logprobs: int | None, field: str, **fields: Any) -> Request:
        """A request for a rendered prompt; checks that it can fit the pool and, with a continued
        message, the context (`field` names that message in the error)."""
        key = build_key(rendered, operations)
        if len(key) + params.max_tokens > self.cache.allocator.total:
            raise KVCapacityError(f"messages: the prompt ({len(key)} tokens) plus max_tokens "
                                  f"({params.max_tokens}) exceeds the KV pool ({self.cache.allocator.total} slots)")
        continuation = fields.get("continuation", ())
        if continuation:
            fed = len(continuation) - (params.max_tokens == len(continuation))
            end = plan_request(RadixCache(SlotAllocator(1)), key).end_position + fed
            if end > self.context_length:
                raise ContextLengthExceeded(field, end, self.context_length)
        kind, scoring = (Request, {}) if top_logprobs is None else (ScoredRequest, {"top_logprobs": top_logprobs})
        return kind(RequestHandle(), key, params, StreamText(self.tokenizer.decode, params.stop),
                    generator_for(params.seed), frozenset(self.tokenizer.eos_token_ids), **fields, **scoring)

    def _queue(self, request: Request) -> RequestHandle:
        self._inbox.put(request)
        self._wakeup.set()
        return request.handle

    def _wait(self, handle: RequestHandle) -> Generation:
        if not self._loop_running:
            while not handle.done:
                self.step()
        return handle.result()

    # -- the loop side ---------------------------------------------------------------------------

    def run_forever(self, stop_event: threading.Event) -> None:
        """Step until `stop_event` is set; sleeps while there is nothing to do."""
        self._loop_running = True
        try:
            while not stop_event.is_set():
                try:
                    busy = self.step()
                except Exception:   # the failed requests got an error event; the loop keeps serving
                    _log.exception("engine step failed")
                    continue
                if not busy:
                    self._wakeup.wait(timeout=0.05)
                    self._wakeup.clear()
        finally:
            self._loop_running = False

    def step(self) -> bool:
        """One scheduling step; returns whether any work was done.

        A failure while serving one request (planning, re-rotating, its forward, sampling)
        ends that request alone with an ERROR_ENGINE event; the others carry on.
        """
        with self._lock:
            self._take_inbox()
            self._end_cancelled()
            _, refused = self.scheduler.admit()
            for request, reason, code in refused:
                request.handle.put(RequestEvent(None, "", FINISH_ERROR, Usage.of_prompt(0, 0, 0, 0), reason, code))
            running = list(self.scheduler.running)
            if not running:
                return bool(refused)
            self._forward_and_sample(running)
            return True

    def _take_inbox(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _end_cancelled(self) -> None:
        for request in [r for r in self.scheduler.waiting if r.handle.cancelled]:
            self.scheduler.remove_waiting(request)
            request.handle.put(RequestEvent(None, "", FINISH_CANCELLED, Usage.of_prompt(0, 0, 0, 0)))
        for request in [r for r in self.scheduler.running if r.handle.cancelled]:
            self._finish(request, FINISH_CANCELLED)

    def _forward_and_sample(self, running: list[Request]) -> None:
        parts = []
        for request, rows in self._plan_rows(running):
            try:
                parts.append(self._part(request, rows))
            except Exception as error:
                self._fail(request, error)
        done = self._forward(parts)
        # Sampling works on rows of a vocabulary's length: one torch thread (no OpenMP threads left spinning on
        # the cores the next step's kernels use; akv_core.threads.phase_threads).
        with torch_threads(1) if self.kv.device.type == "cpu" else nullcontext():
            for part, logits in done:
                request = part.request
                try:
                    if request.prefilling:
                        request.advance(len(part.ids))
                        self._publish(request)
                    if logits is None:
                        continue
                    if request.continuation and not request.generated:
                        self._feed_continuation(request)
                    else:
                        self._sample(request, logits)
                except Exception as error:
                    self._fail(request, error)

    def _sample(self, request: Request, logits: torch.Tensor) -> None:
        """Choose the request's next token from its logits row and take it."""
        if self.logits_probe is not None:
            self.logits_probe(request.handle, logits)
        scored = log_probs(logits) if isinstance(request, ScoredRequest) else None   # before the mask
        if request.constraint is not None:
            request.constraint.mask(logits)
        token = sample(logits, request.params.temperature, request.params.top_p, request.generator)
        if request.constraint is not None:
            token = request.constraint.keep_within(token, self._tokens_left(request))
        self._accept(request, token, None if scored is None else token_logprob(scored, token, request.top_logprobs))

    def _feed_continuation(self, request: Request) -> None:
        """The prompt is computed: feed the continued message in one teacher-forced pass (its scores, and
        its attribution when nothing is generated after it), then sample the first new token from the
        pass's last row, or end the request when it generates none."""
        reply = list(request.continuation)
        generates = request.params.max_tokens > len(reply)
        fed = reply if generates else reply[:-1]
        rows = self._forced_rows(request, fed, [request.lease.take_decode_slot() for _ in fed])
        attend = request.provenance is not None
        targets = reply if request.continuation_scored else ()
        result = self._forced(rows, targets, request.continuation_top, attend, last_logits=generates)
        if request.continuation_scored:
            request.continuation_scores = tuple(result.scores)
        request.generated.extend(reply)
        if attend:
            request.attention_mass = fold_scratch(result.slot_mass, rows, request.layout.view_slots[-1])
            request.mass_rows = len(rows.tokens)
            if not generates:
                request.attribution = self._attribution(request)
        if generates:
            self._sample(request, result.last_logits)
        else:
            self._finish(request, FINISH_LENGTH)

    def _forced_rows(self, request: Request, fed: list[int], slots: list[int]) -> ForcedRows:
        """The rows that produced `fed` plus the next token: the last prompt token again (into the scratch
        slot after `slots`, so the cached prompt KV is never rewritten), then `fed` into `slots`."""
        lease, end = request.lease, request.layout.end_position
        if slots != lease.decode_slots[:len(fed)] or lease.decode_used != len(fed):
            raise RuntimeError(f"{len(fed)} reply tokens but {lease.decode_used} decode slots taken")
        scratch = lease.decode_slots[len(fed)]
        return ForcedRows([request.key.tokens[-1], *fed], list(range(end - 1, end + len(fed))), [scratch, *slots],
                          list(request.layout.view_slots[:-1]))

    def _forced(self, rows: ForcedRows, targets: Sequence[int], top: int | None, attention: bool,
                last_logits: bool = True) -> ForcedResult:
        """One teacher-forced pass (akv_core.forcing), counted as a prefill pass."""
        started = time.perf_counter()
        with self._phase_threads("prefill", len(rows.tokens), False):
            result = forced_pass(self.model, self.kv, rows, targets, top, attention, last_logits)
        self._passes["prefill"][0] += 1
        self._passes["prefill"][1] += time.perf_counter() - started
        return result

    def _attribution(self, request: Request) -> Attribution:
        """The reply's attribution from the attention weights its `mass_rows` (one per generated token) put on
        each pool slot, added up as each query ran (`_take_masses`: the prompt's last row, then the decode rows;
        a continued message's rows in its teacher-forced pass): the visible prompt's slots, then the decode slots
        of every reply token fed."""
        config, rows = self.model.config, len(request.generated)
        if request.mass_rows != rows:
            raise RuntimeError(f"attention of {request.mass_rows} rows for {rows} reply tokens")
        return reply_attribution(request.attention_mass, request.layout.view_slots,
                                 request.lease.decode_slots[:rows - 1], rows, request.provenance,
                                 visible_offsets(request.key), config.num_layers, config.num_heads)

    @staticmethod
    def _queries_reply(part: _Part) -> bool:
        """Whether the part's last row is the query of a reply token whose attention the request asked for: a
        decode row, or the prompt's last (it samples the first token), unless a continued message's teacher-forced
        pass computes that row again."""
        request = part.request
        return (request.provenance is not None and part.samples
                and not (request.continuation and not request.generated))

    def _take_masses(self, parts: list[_Part], masses: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add a pass's attention weights (sequence index -> its slots, the weight its last row put on each) to
        the requests' totals per pool slot."""
        for index, (slots, weights) in masses.items():
            request = parts[index].request
            if request.attention_mass is None:
                request.attention_mass = torch.zeros(self.kv.num_slots, dtype=torch.float64, device=self.kv.device)
            request.attention_mass.index_add_(0, slots, weights.to(torch.float64))
            request.mass_rows += 1

    def _publish(self, request: Request) -> None:
        """Share the request's computed prompt through the cache: all of it once its prefill is done,
        the part computed so far while a waiting request shares it (akv_core.scheduler)."""
        if request.prompt_computed:
            self.cache.publish(request.lease)
        elif request.awaited:
            self.cache.publish(request.lease, request.computed_tokens)

    def _plan_rows(self, running: list[Request]) -> list[tuple[Request, int]]:
        """(request, prompt rows) for this step: every decoding request, and prompt chunks.

        The prompt rows of all requests share a budget of `prefill_chunk` tokens, taken by
        the requests with the least prompt left first (a short prompt starts decoding at once
        beside a long one), except that a request that got no rows in the last step goes
        first (every prefilling request moves at least every other step), and, after it, one
        that waiting requests share (what it publishes lets them in). One stage per request
        per step (the next stage's re-rotations read this stage's keys).
        """
        plan = [(request, 0) for request in running if not request.prefilling]
        prefilling = [request for request in running if request.prefilling]
        budget = self.prefill_chunk
        for request in sorted(prefilling, key=lambda r: (not r.passed_over, not r.awaited, r.prefill_left)):
            rows = request.stage_rows_left if budget is None else min(budget, request.stage_rows_left)
            request.passed_over = rows == 0
            if rows:
                plan.append((request, rows))
                budget = None if budget is None else budget - rows
        return plan

    def _part(self, request: Request, rows: int) -> _Part:
        """The request's rows of this step: `rows` prompt rows of its stage (re-rotations with the
        stage's first rows) or one decode token."""
        if request.prefilling:
            stage = request.layout.stages[request.next_stage]
            chunk = stage.rows(request.next_row, request.next_row + rows)
            self._rerotate(chunk.rerotations)
            last = request.next_stage == len(request.layout.stages) - 1 and rows == request.stage_rows_left
            return _Part(request, chunk.token_ids, chunk.positions, chunk.out_slots, _slots(chunk.kv_slots),
                         _stage_mask(chunk), samples=last)
        slot = request.lease.take_decode_slot()
        if request.decode_kv is None:   # the visible prompt, then every reserved decode slot
            request.decode_kv = _slots(request.layout.view_slots + request.lease.decode_slots).to(self.kv.device)
        visible = len(request.layout.view_slots) + request.lease.decode_used
        return _Part(request, [request.generated[-1]], [request.layout.end_position + len(request.generated) - 1],
                     [slot], request.decode_kv[:visible], None, samples=True)

    def _forward(self, parts: list[_Part]) -> list[tuple[_Part, torch.Tensor | None]]:
        """Each part that ran, with the logits of its last row if it samples.

        The parts run in one batch; if that forward fails, each runs alone, so that only
        the requests whose own forward fails are failed.
        """
        if len(parts) > 1:
            try:
                return list(zip(parts, self._run(parts)))
            except Exception as error:
                _log.warning("a batched forward failed (%s); running its requests one at a time", error)
        done = []
        for part in parts:
            try:
                done.append((part, self._run([part])[0]))
            except Exception as error:
                self._fail(part.request, error)
        return done

    def _run(self, parts: list[_Part]) -> list[torch.Tensor | None]:
        batch = self._batch(parts)
        phase = "prefill" if any(part.request.prefilling for part in parts) else "decode"
        started = time.perf_counter()
        masses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        wanted = frozenset(index for index, part in enumerate(parts) if self._queries_reply(part))
        if wanted:
            self.model.mass_probe = MassProbe(wanted, lambda index, slots, weights: masses.__setitem__(index,
                                                                                                   (slots, weights)))
        try:
            with self._phase_threads(phase, batch.input_ids.numel(), self.model.decodes_on_kernels(batch, self.kv)):
                logits = self.model.forward(batch, self.kv)
        finally:
            self.model.mass_probe = None
        self._take_masses(parts, masses)
        rows = self._logits_of(parts, logits)
        self._passes[phase][0] += 1
        self._passes[phase][1] += time.perf_counter() - started
        return rows

    @staticmethod
    def _logits_of(parts: list[_Part], logits: torch.Tensor) -> list[torch.Tensor | None]:
        rows = iter(logits.float().cpu())   # sampling generators live on the CPU
        return [next(rows) if part.samples else None for part in parts]

    def _batch(self, parts: list[_Part]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        seqs: list[SeqAttention] = []
        logits_rows: list[int] = []
        for part in parts:
            seqs.append(SeqAttention(len(ids), len(part.ids), part.kv_slots, part.mask))
            ids += part.ids
            positions += part.positions
            out_slots += part.out_slots
            if part.samples:
                logits_rows.append(len(ids) - 1)
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                             _slots(out_slots), seqs, torch.tensor(logits_rows, dtype=torch.long))
        return _to_device(batch, self.kv.device)

    def _rerotate(self, work: Rerotations) -> None:
        """Write re-rotated copies of keys (values copied as they are) into their new slots."""
        if not work.dst:
            return
        device = self.kv.device
        src, dst = _slots(work.src).to(device), _slots(work.dst).to(device)
        old, new = _slots(work.old_positions).to(device), _slots(work.new_positions).to(device)
        with torch.inference_mode():
            for layer in range(self.kv.num_layers):
                self.kv.k[layer][dst] = self.model.rope.rerotate(self.kv.k[layer][src], old, new)
                self.kv.v[layer][dst] = self.kv.v[layer][src]

    def _accept(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        """Take a sampled token: stream it (with its log probabilities, if asked), and finish the
        request if it is done."""
        request.generated.append(token)
        grammar_done = request.constraint is not None and request.constraint.advance(token)
        if token in request.eos_token_ids:
            self._finish(request, FINISH_STOP)
            return
        delta = request.stream.feed(token)
        event = RequestEvent(token, delta) if logprob is None else ScoredEvent(token, delta, logprob=logprob)
        request.handle.put(event)
        if grammar_done:   # a forced call closed because its tokens ran out was cut off all the same
            self._finish(request, FINISH_LENGTH if request.constraint.cut_short else FINISH_STOP)
        elif request.stream.stopped:
            self._finish(request, FINISH_STOP)
        elif len(request.generated) >= request.params.max_tokens:
            self._finish(request, FINISH_LENGTH)
        elif request.layout.end_position + len(request.generated) > self.context_length:
            self._finish(request, FINISH_LENGTH)   # the token would be fed past the context

    def _tokens_left(self, request: Request) -> int:
        """The tokens the request may still take, the next one included: up to max_tokens, and up to
        the one fed at the end of the context (`_accept`)."""
        generated = len(request.generated)
        return min(request.params.max_tokens - generated,
                   self.context_length - request.layout.end_position - generated + 1)

    def _finish(self, request: Request, reason: str) -> None:
        if (request.provenance is not None and request.attribution is None and request.generated
                and reason in (FINISH_STOP, FINISH_LENGTH)):
            request.attribution = self._attribution(request)
        usage = _usage_of(request)
        self.scheduler.finish(request)
        for name in self._totals:
            if name == "requests_finished":
                self._totals[name] += 1
            else:
                self._totals[name] += getattr(usage, name)
        request.handle.put(RequestEvent(None, request.stream.flush(), reason, usage, attribution=request.attribution,
                                        continuation_scores=request.continuation_scores))

    def _fail(self, request: Request, error: Exception) -> None:
        """End one request whose work failed: its slots are freed, its client gets an ERROR_ENGINE event."""
        _log.error("engine error while serving a request: %s", error, exc_info=error)
        try:
            self.scheduler.abort(request)
        finally:   # the client hears of it even if the failure was in releasing the request
            if not request.handle.done:
                request.handle.put(RequestEvent(None, "", FINISH_ERROR, Usage.of_prompt(0, 0, 0, 0),
                                                f"engine error: {error}", ERROR_ENGINE))

    def _phase_threads(self, phase: str, new_tokens: int, kernels: bool) -> AbstractContextManager:
        if self.kv.device.type != "cpu":
            return nullcontext()
        if self._threads is None:
            return phase_threads(phase, new_tokens, kernels)
        torch_count = 1 if kernels else self._threads[phase]   # on the kernels, as phase_threads does
        if torch.get_num_threads() != torch_count:
            torch.set_num_threads(torch_count)
        return kernel_threads(self._threads[phase]) if kernels else nullcontext()

    def clear_cache(self) -> None:
        """Empty the radix cache, as a fresh engine's; RuntimeError while requests are queued or running."""
        with self._lock:
            if self.scheduler.running or self.scheduler.waiting or not self._inbox.empty():
                raise RuntimeError("cannot clear the cache while requests are queued or running")
            self.cache.clear()

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        pool = self.cache.stats()
        return EngineStats(pool.slots_total, pool.slots_used, pool.slots_free, pool.slots_cached,
                           len(self.scheduler.running), len(self.scheduler.waiting) + self._inbox.qsize(),
                           **self._totals, prefill_passes=self._passes["prefill"][0],
                           decode_passes=self._passes["decode"][0], prefill_pass_seconds=self._passes["prefill"][1],
                           decode_pass_seconds=self._passes["decode"][1], kv_slots_retained=pool.slots_retained,
                           kv_slots_retained_evicted=pool.slots_retained_evicted)

    def check_integrity(self) -> None:
        """AssertionError unless every KV slot has one owner and lock refs match the running requests."""
        with self._lock:
            self.cache.check_integrity()
            leases = {id(r.lease) for r in self.scheduler.running}
            if len(leases) != len(self.scheduler.running) or any(r.lease is not None for r in self.scheduler.waiting):
                raise AssertionError("engine integrity: a lease is shared or held by a waiting request")


@dataclass
class _Part:
    """One request's rows in a forward: prompt tokens of a stage, or one decode token."""

    request: Request
    ids: list[int]
    positions: list[int]
    out_slots: list[int]
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    samples: bool           # whether the logits of its last row choose the request's next token


def _usage_of(request: Request) -> Usage:
    """The request's usage: a continued message's tokens, once fed, are prompt tokens it computed."""
    fed = min(len(request.continuation), len(request.generated))
    usage = request.usage
    if fed:
        usage = replace(usage, prompt_tokens=usage.prompt_tokens + fed, total_tokens=usage.total_tokens + fed,
                        prefilled_tokens=usage.prefilled_tokens + fed)
    return usage.with_completion(len(request.generated) - fed)


def _check_reply_options(attribution: Any, continue_final_message: Any, prompt_logprobs: Any,
                         grammar: Grammar | None) -> None:
    """ValueError naming the field unless the reply options are well-typed and go together."""
    for field, value in (("attribution", attribution), ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise ValueError(f"{field}: must be true or false, got {value!r}")
    if prompt_logprobs is not None:
        if (isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int)
                or not 0 <= prompt_logprobs <= TOP_LOGPROBS_MAX):
            raise ValueError(f"prompt_logprobs: must be an integer from 0 to {TOP_LOGPROBS_MAX}, "
                             f"got {prompt_logprobs!r}")
        if not continue_final_message:
            raise ValueError("prompt_logprobs: scores the final message's tokens, so it needs continue_final_message")
    if continue_final_message and grammar is not None:
        raise ValueError("continue_final_message: cannot be combined with a grammar (the message was not written "
                         "under it)")


def _slots(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _stage_mask(stage: Stage) -> torch.Tensor | None:
    """Each new token sees the columns up to its own, minus the drops that happen inside the stage."""
    if not stage.hidden and stage.queries_last:
        return None
    columns = torch.tensor(stage.query_columns, dtype=torch.long)
    mask = torch.arange(len(stage.kv_slots))[None, :] <= columns[:, None]
    for row, hidden in stage.hidden:
        mask[row:, list(hidden)] = False
    return mask


def _to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    if device.type == "cpu":
        return batch
    seqs = [SeqAttention(s.q_start, s.q_len, s.kv_slots.to(device), None if s.mask is None else s.mask.to(device))
            for s in batch.seqs]
    return ForwardBatch(batch.input_ids.to(device), batch.positions.to(device), batch.out_slots.to(device), seqs,
                        batch.logits_rows.to(device))


def _default_kv_tokens(model: Any, device: str) -> int:
    """CPU: four contexts' worth of slots; CUDA: half of the free memory."""
    if device == "cpu":
        return max(DEFAULT_CPU_KV_TOKENS, 4 * model.config.context_length)
    free, _ = torch.cuda.mem_get_info()
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8
    return max(1024, int(free * 0.5) // per_token)
