"""What constrained decoding costs, and that requests without a grammar pay nothing, in one run.

    python benchmarks/constrained.py [--tokens 32] [--rounds 5]

Three contenders generate the same greedy tokens for the same prompt on one engine (SmolLM2,
fp32, one thread), taking turns each round so that load from other processes falls on all alike:

- `free`: no grammar (the engine path every unconstrained request takes);
- `permissive`: a regex that allows any text, so the tokens are the same and the difference is the
  matcher's work per token (mask, apply, advance);
- `policy`: the policy grammar (`policy_dsl.constrained_grammar()`), the proposer's constraint;
  its tokens differ, so its figure is per generated token.

Reported: CPU ms per generated token (median over rounds), the ratio to `free`, and the mask
work alone in microseconds per token. An unconstrained request executes two `is None` checks per
token of this module's code; their cost is timed too, in nanoseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch

from akv_core.constrain import Grammar
from akv_core.engine import Engine
from policy_dsl import builtin_source, constrained_grammar

PROMPT = [{"role": "system", "content": "You write KV-cache policies. An example:\n" + builtin_source("expert-8k")},
          {"role": "user", "content": "Write a new policy."}]


def cpu_ms_per_token(engine: Engine, grammar: Grammar | None, tokens: int) -> tuple[float, list[int]]:
    started = time.process_time()
    out = engine.generate(PROMPT, max_tokens=tokens, grammar=grammar)
    return (time.process_time() - started) * 1000 / len(out.token_ids), out.token_ids


def mask_us_per_token(engine: Engine, grammar: Grammar, token_ids: list[int]) -> float:
    """The matcher's work alone (mask, apply to a logits row, advance) over a recorded output."""
    constraint = engine.constrainer.start(grammar)
    row = torch.zeros(engine.model.config.vocab_size)
    started = time.perf_counter()
    for token in token_ids:
        constraint.mask(row)
        constraint.advance(token)
    return (time.perf_counter() - started) * 1e6 / len(token_ids)


def measure(tokens: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    loaded = Engine.from_pretrained("smollm2", device="cpu", kv_tokens=4096)
    engine = Engine(loaded.model, loaded.tokenizer, 4096, threads={"prefill": 1, "decode": 1})
    contenders = {"free": None, "permissive": Grammar.regex(r"(.|\n)*"),
                  "policy": Grammar.lark(constrained_grammar())}
    cpu_ms_per_token(engine, contenders["policy"], 1)   # compile and cache the grammars, warm the prompt
    cpu_ms_per_token(engine, contenders["permissive"], 1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    outputs: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, grammar in contenders.items():
            ms, outputs[name] = cpu_ms_per_token(engine, grammar, tokens)
            times[name].append(ms)
    if outputs["permissive"] != outputs["free"]:
        raise AssertionError("a permissive grammar changed the greedy tokens")
    median = {name: statistics.median(values) for name, values in times.items()}
    request = type("R", (), {"constraint": None})()
    check_ns = timeit.timeit(lambda: request.constraint is not None, number=200_000) / 200_000 * 1e9
    return {
        "ms_per_token": {name: round(value, 2) for name, value in median.items()},
        "ratio_to_free": {name: round(value / median["free"], 3) for name, value in median.items()},
        "mask_us_per_token": {name: round(mask_us_per_token(engine, contenders[name], outputs[name]), 1)
                              for name in ("permissive", "policy")},
        "free_path_check_ns_per_token": round(2 * check_ns, 1),
        "tokens": tokens, "rounds": rounds,
    }


def render(figures: dict) -> str:
    lines = ["| contender | CPU ms/token | vs free | mask work, us/token |", "| --- | --- | --- | --- |"]
    for name, ms in figures["ms_per_token"].items():
        mask = figures["mask_us_per_token"].get(name)
        lines.append(f"| {name} | {ms} | {figures['ratio_to_free'][name]}x | {'-' if mask is None else mask} |")
    lines.append(f"\nThe unconstrained path's own cost: {figures['free_path_check_ns_per_token']} ns per token "
                 f"({figures['tokens']} tokens, median of {figures['rounds']} rounds).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three contenders")
    args = parser.parse_args()
    print(render(measure(args.tokens, args.rounds)))


if __name__ == "__main__":
    main()
