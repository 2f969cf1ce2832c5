"""The llm proposer: a chat model rewrites a front parent, given what happened in its trajectories.

The system prompt holds the language reference (grammar and built-in examples); the prompt
(evolve/proposers/prompt.py) holds the parent with its per-task train results, the digests of its
worst and most expensive train tasks (evolve/reflection.py), and the Pareto front, fitted to
`llm.context_tokens`. The model writes a short diagnosis, then the policy: the answer's last fenced
block is the policy, the text before it the diagnosis (kept in the proposal's meta, shown by
`akv lineage` and the report). A parse or validation error goes back once for repair. Transient
endpoint failures are retried with backoff; token and USD budgets are enforced before every request.
Where the endpoint takes a `lark` grammar (`llm.constrain`), the whole answer is decoded under
`answer_grammar(diagnosis_room(config))`: "Diagnosis: " and one bounded paragraph, then the fenced
block holding one policy of `policy_dsl.constrained_grammar()`.
An answer cut off by max_tokens is rejected as truncated.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Sequence

import openai

from evolve.candidate import check_policy, rejection
from evolve.config import LLMProposerConfig
from evolve.context import Candidate, ProposerContext
from evolve.proposers.base import BudgetExhausted, Proposer, ProposerUnavailable
from evolve.proposers.hindsight import evidence, needs_of
from evolve.proposers.prompt import MOST_MESSAGE_OVERHEAD, PromptTooLong, extract_diagnosis, fit_prompt
from policy_dsl import PolicyError, constrained_grammar
from policy_dsl.counter import CHARS_PER_TOKEN
from sandbox.backends.tokens import shared_tokenizer
from store.records import Proposal

_log = logging.getLogger(__name__)
FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)

SYSTEM = """You design KV-cache policies for LLM agents in the AKV policy language.
A policy decides which earlier messages' KV entries attention may still see (drop) and when the
survivors are compacted (reposition). Lower cost comes from dropping stale tool output; score is lost
when facts the agent still needs are dropped. The system prompt, the first user message and the
latest message are always protected.

Grammar (lark):
{grammar}
Examples:
{examples}
Answer with a one-paragraph diagnosis, then exactly one policy in a fenced block:
Diagnosis: <what the parent's drops cost and lose, in one paragraph>

```akvp
<policy>
```"""


POLICY_TOKENS = 128      # room a constrained policy block needs in the answer (sampled ones: about 40)
# A bound, not policy_dsl's estimate (CHARS_PER_TOKEN, 4): a diagnosis of this many characters per
# token of room surely fits before the policy block, whatever its words.
FEWEST_CHARS_PER_TOKEN = 3
MIN_DIAGNOSIS = 40       # the shortest diagnosis worth asking for (llm.diagnosis_chars' lower bound)


def diagnosis_room(config: LLMProposerConfig) -> int:
    """Characters of diagnosis a constrained answer may hold: llm.diagnosis_chars, as far as
    max_tokens leaves room for it before the policy block; 0 (no diagnosis) when under MIN_DIAGNOSIS."""
    room = min(config.diagnosis_chars, (config.max_tokens - POLICY_TOKENS) * FEWEST_CHARS_PER_TOKEN)
    return room if room >= MIN_DIAGNOSIS else 0


def answer_grammar(diagnosis_chars: int = 0) -> str:
    """The Lark grammar of a constrained answer: the policy in its fenced block, nothing else.

    With `diagnosis_chars` > 0 a one-paragraph diagnosis of at most that many characters (no
    newline, no backtick; its first character a letter or digit, so that it says something) comes
    first, after "Diagnosis: ", so a model can reason before the policy while the grammar still
    holds the policy part exactly.
    """
    fence = '"```akvp\\n" policy "\\n```"'
    if diagnosis_chars > 0:
        head = (f'start: "Diagnosis: " DIAGNOSIS "\\n\\n" {fence}\n'
                f"DIAGNOSIS: /\\w[^`\\n]{{0,{diagnosis_chars - 1}}}/\n")
    else:
        head = f"start: {fence}\n"
    return head + constrained_grammar("policy")


def extract_policy(answer: str) -> str | None:
    """The last fenced block of a model answer, or None."""
    blocks = FENCE.findall(answer or "")
    return blocks[-1].strip() if blocks else None


def language_reference(examples: Sequence[str]) -> str:
    grammar = resources.files("policy_dsl").joinpath("grammar.lark").read_text(encoding="utf-8")
    shown = "\n".join(f"```akvp\n{t.strip()}\n```" for t in examples)
    return SYSTEM.format(grammar=grammar.strip(), examples=shown)


def endpoint_of(config: LLMProposerConfig) -> str | None:
    """The endpoint the proposer would use: llm.endpoint, else $AKV_PROPOSER_ENDPOINT, else $OPENAI_BASE_URL."""
    return config.endpoint or os.environ.get("AKV_PROPOSER_ENDPOINT") or os.environ.get("OPENAI_BASE_URL")


@dataclass
class Spend:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usd: float = 0.0
    calls: list[tuple[int, int]] = field(default_factory=list)


class LLMProposer(Proposer):
    name = "llm"
    reads_timelines = True

    def __init__(self, config: LLMProposerConfig, examples: Sequence[str], spent_tokens: int = 0,
                 spent_usd: float = 0.0, sleep=time.sleep, grammar: str | None = None) -> None:
        self.config = config
        endpoint = endpoint_of(config)
        if not endpoint:
            raise ProposerUnavailable("llm.endpoint: no endpoint (set --proposer-endpoint, llm.endpoint "
                                      "or AKV_PROPOSER_ENDPOINT)")
        self.endpoint = endpoint
        self.client = openai.OpenAI(base_url=endpoint, api_key=os.environ.get(config.api_key_env) or "none",
                                    max_retries=0, timeout=config.timeout_s)
        self.system = language_reference(examples)
        self.spent_tokens, self.spent_usd = spent_tokens, spent_usd
        self.sleep = sleep
        tokenizer = shared_tokenizer()  # the embedded model's: exact for it, an estimate for others
        self.count = lambda text: len(tokenizer.encode_text(text))
        # The grammar sent as `lark` while the endpoint takes it; None once `auto` fell back.
        self.grammar = None if config.constrain == "off" else (grammar or answer_grammar(diagnosis_room(config)))
        self.note: str | None = None   # why the grammar was turned off, told with the next proposal
        self._evidence_of: dict[tuple[int, int], list[str]] = {}   # (needs, parent) -> hindsight evidence

    def ask(self, context: ProposerContext) -> Proposal:
        parent = context.pick_parent()
        others = [c for c in context.front if c.policy_id != parent.policy_id][: self.config.inspirations]
        config = self.config
        try:
            prompt = fit_prompt(self.system, parent, others, context.front, config.context_tokens, config.max_tokens,
                                config.digest_tasks, self.count, self._evidence(context, parent))
        except PromptTooLong as err:  # never sent over the model's context
            return Proposal(self.name, None, (parent.policy_id,), parent.generation + 1,
                            rejection_reason=f"prompt too long: {err}; raise llm.context_tokens or lower "
                            "llm.max_tokens")
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": prompt.text}]
        spend = Spend()
        constrained = self.grammar is not None
        answer, finish = self._chat(messages, spend)
        transcript = [answer]
        reason, checked = self._check(answer, finish)
        if reason is not None and config.repair and "invalid policy" in reason:
            repair = [{"role": "assistant", "content": answer},
                      {"role": "user", "content": f"That policy is not valid: {reason}. "
                       "Reply with the corrected policy in one fenced block."}]
            needed = prompt.tokens + sum(self.count(m["content"]) + MOST_MESSAGE_OVERHEAD for m in repair)
            if needed + config.max_tokens > config.context_tokens:
                reason += " (no repair: it would not fit llm.context_tokens)"
            else:
                messages += repair
                answer, finish = self._chat(messages, spend)
                transcript.append(answer)
                reason, checked = self._check(answer, finish)
                if reason is not None:
                    reason = f"after one repair: {reason}"
        diagnosis = next(filter(None, (extract_diagnosis(a, config.diagnosis_chars) for a in transcript)), None)
        note, self.note = self.note, None
        return Proposal(
            self.name, raw_text=extract_policy(answer), parent_ids=(parent.policy_id,),
            generation=parent.generation + 1, text=checked.text if checked else None,
            hash=checked.hash if checked else None, rejection_reason=reason,
            prompt="\n\n".join(m["content"] for m in messages), response="\n\n---\n\n".join(transcript),
            prompt_tokens=spend.prompt_tokens, completion_tokens=spend.completion_tokens, cost_usd=spend.usd,
            meta={"model": self.config.model, "endpoint": self.endpoint, "repaired": len(transcript) > 1,
                  "diagnosis": diagnosis, "digests": list(prompt.digested), "digests_shortened": prompt.shortened,
                  "request_tokens": prompt.tokens,
                  "constrained": constrained and self.grammar is not None, **({"note": note} if note else {})},
        )

    def _evidence(self, context: ProposerContext, parent: Candidate) -> list[str]:
        """The hindsight evidence reflect reads, on recorded traces (none elsewhere), once per parent."""
        needs = needs_of(context.population)
        if needs is None or not parent.timelines:
            return []
        key = (needs.policy_id, parent.policy_id)
        if key not in self._evidence_of:
            self._evidence_of[key] = evidence(needs, parent)
        return self._evidence_of[key]

    def _check(self, answer: str, finish_reason: str | None):
        if finish_reason == "length":
            return (f"truncated: the answer was cut off at max_tokens ({self.config.max_tokens}); "
                    "a cut-off answer is never adopted"), None
        text = extract_policy(answer)
        if text is None:
            return "no policy: the answer has no fenced block", None
        try:
            return None, check_policy(text, filename="proposal.akvp")
        except PolicyError as err:
            return rejection(err), None

    def _chat(self, messages: list[dict], spend: Spend) -> tuple[str, str | None]:
        """The answer's text and finish reason; the spend is counted first."""
        if self.spent_tokens >= self.config.max_total_tokens:
            raise BudgetExhausted(f"llm token budget spent ({self.spent_tokens} >= {self.config.max_total_tokens})")
        if self.spent_usd >= self.config.max_usd:
            raise BudgetExhausted(f"llm USD budget spent (${self.spent_usd:.4f} >= ${self.config.max_usd})")
        reply = self._request(messages)
        usage = reply.usage
        p_tok = usage.prompt_tokens if usage else sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN
        c_tok = usage.completion_tokens if usage else len(reply.choices[0].message.content or "") // CHARS_PER_TOKEN
        usd = (p_tok * self.config.price_input_per_m + c_tok * self.config.price_output_per_m) / 1e6
        spend.prompt_tokens += p_tok
        spend.completion_tokens += c_tok
        spend.usd += usd
        self.spent_tokens += p_tok + c_tok
        self.spent_usd += usd
        choice = reply.choices[0]
        return choice.message.content or "", choice.finish_reason

    def _request(self, messages: list[dict]):
        delay = self.config.backoff_s
        last = ""
        for attempt in range(self.config.retries + 1):
            try:
                return self.client.chat.completions.create(
                    model=self.config.model, messages=messages, temperature=self.config.temperature,
                    max_tokens=self.config.max_tokens,
                    extra_body={"lark": self.grammar} if self.grammar is not None else None)
            except (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                    openai.InternalServerError) as err:
                last = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            except openai.APIStatusError as err:  # 4xx other than 429: retrying will not help
                if self._grammar_refused(err):
                    return self._request(messages)   # once: the grammar is off from now on
                raise ProposerUnavailable(f"llm endpoint {self.endpoint} refused the request: "
                                          f"HTTP {err.status_code} {str(err.message)[:200]}") from None
            if attempt < self.config.retries:
                self.sleep(delay)
                delay *= 2
        raise ProposerUnavailable(f"llm endpoint {self.endpoint} failed after {self.config.retries + 1} "
                                  f"attempts ({last})")

    def _grammar_refused(self, err: openai.APIStatusError) -> bool:
        """A 400 naming the `lark` field under `constrain: auto` turns the grammar off, with a note."""
        if self.grammar is None or self.config.constrain != "auto" or err.status_code != 400:
            return False
        if err.param != "lark" and "lark" not in str(err.message):
            return False
        self.grammar = None
        self.note = (f"llm endpoint {self.endpoint} refused the lark grammar ({str(err.message)[:160]}); "
                     "proposing unconstrained, with repair, from now on")
        _log.warning("note: %s", self.note)
        return True
