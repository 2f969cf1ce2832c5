"""A step's forward as passes side by side (akv_core.passes): how the parts are split, the runner, and the
real SmolLM2 engine serving requests together in two passes exactly as it serves them one after another."""
from __future__ import annotations

import threading

import pytest
import torch

from akv_core import passes
from akv_core.engine import Engine
from test_engine_model import assert_same_logits
from test_engine_sharing import HISTORIES, probe_logits, serial, shared  # noqa: F401  (fixtures)
from test_model_support import run_together


def _covers(groups: list[list[int]], count: int) -> bool:
    return sorted(i for g in groups for i in g) == list(range(count)) and all(g == sorted(g) for g in groups)


def test_the_split_balances_the_parts_and_keeps_one_pass_when_it_would_not_pay():
    decode = passes.part_cost(1, 600, decode=True)
    eight = passes.split([decode] * 8, 2)
    assert eight is not None and _covers(eight, 8) and [len(g) for g in eight] == [4, 4]
    prompts = passes.split([passes.part_cost(230, 560, decode=False)] * 2 + [passes.part_cost(100, 430, False)], 2)
    assert prompts is not None and _covers(prompts, 3) and len(prompts) == 2
    # one long prompt chunk beside a few decode rows: one pass (its products use every idle core)
    assert passes.split([passes.part_cost(512, 512, decode=False)] + [decode] * 7, 2) is None
    assert passes.split([decode] * 2, 2) is None          # too little to gain from a second pass
    assert passes.split([decode] * 8, 1) is None and passes.split([500.0], 2) is None
    longer = passes.part_cost(1, 8000, decode=True)
    assert longer > decode and passes.part_cost(10, 100, False) < passes.part_cost(10, 8000, False)


def test_the_runner_returns_in_order_and_raises_only_once_every_pass_has_ended():
    runner = passes.SideBySide(1)
    names = runner.run([lambda: threading.current_thread().name, lambda: threading.current_thread().name])
    assert names[0] == threading.current_thread().name and names[1].startswith("akv-pass")
    before = torch.get_num_threads()
    ended = threading.Event()

    def slow() -> int:
        assert torch.get_num_threads() == 1
        ended.wait(0.2)
        ended.set()
        return 2

    def failing() -> int:
        raise RuntimeError("pass failed")

    with pytest.raises(RuntimeError, match="pass failed"):
        runner.run([failing, slow])
    assert ended.is_set() and torch.get_num_threads() == before   # the other pass ran to its end first
    runner.close()


@pytest.mark.model
def test_requests_served_in_two_passes_decode_as_one_after_another(shared, serial, monkeypatch) -> None:  # noqa: F811
    outputs, logits, serial_prefilled = serial
    model, tokenizer = shared
    assert model.passes_safe
    split_steps = []
    real_run = passes.SideBySide.run
    monkeypatch.setattr(passes.SideBySide, "run", lambda self, work: split_steps.append(len(work)) or real_run(self, work))
    engine = Engine(model, tokenizer, 4096, 8, threads={"prefill": 1, "decode": 1, "passes": 2})
    probed = probe_logits(engine)
    handles = [engine.submit(history, max_tokens=4) for history in HISTORIES]
    run_together(engine, handles)   # the cache's invariants after every step
    results = [handle.result() for handle in handles]
    assert split_steps and set(split_steps) == {2}
    assert engine.stats().prefilled_tokens == serial_prefilled
    assert [r.usage for r in results] == [o.usage for o in outputs]
    assert [r.token_ids for r in results] == [o.token_ids for o in outputs]
    for handle, want in zip(handles, logits):
        assert_same_logits(torch.stack(probed[handle]), want)
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_slots_used == stats.kv_slots_cached


@pytest.mark.model
def test_an_attention_probe_keeps_the_step_in_one_pass(shared) -> None:  # noqa: F811
    model, _ = shared
    model.attention_probe = lambda *args: None
    try:
        assert not model.passes_safe   # the probe numbers the sequences of one pass
    finally:
        model.attention_probe = None
    assert model.passes_safe
