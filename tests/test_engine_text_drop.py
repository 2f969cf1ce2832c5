"""text_drop and keep_text_drop on the real SmolLM2 weights: the cut tokens leave attention exactly.

The reference is one forward of the whole prompt with the cut tokens masked from the rows
after the rule's trigger: the engine's logits must equal it (fp32, within 1e-4), and a
repeated request is a full hit that reports the cut tokens as drop_skipped.
"""
from __future__ import annotations

import pytest
import torch

from akv_core.cache.key import build_key
from akv_core.cache.ops import validate_operations
from akv_core.cache.text_drop import parse_text_drop, project_kept
from akv_core.model.batch import ForwardBatch, SeqAttention
from test_engine_model import SECRET, agent, assert_same_logits, new_engine, run, shared  # noqa: F401 (fixture)

pytestmark = pytest.mark.model


def masked_forward(shared, engine, messages, text_drop):
    """The first sampled token's logits of one forward with the cut tokens masked after the trigger."""
    rendered = engine.tokenizer.render(messages)
    [(trigger_end, record)] = build_key(rendered, validate_operations(len(messages), None, None,
                                                                     text_drop=text_drop)).records
    n = len(rendered.token_ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for start, end in record.hidden:
        mask[trigger_end:, start:end] = False
    slots = torch.arange(n)
    batch = ForwardBatch(torch.tensor(rendered.token_ids), torch.arange(n), slots,
                         [SeqAttention(0, n, slots, mask)], torch.tensor([n - 1]))
    hidden = sum(end - start for start, end in record.hidden)
    return shared[0].forward(batch, new_engine(shared, kv_tokens=n).kv), hidden, n


def test_text_drop_equals_a_forward_with_the_cut_masked_and_repeats_as_a_full_hit(shared):
    engine = new_engine(shared)
    cut = parse_text_drop([None, {"role": "user", "content": "4721"}, None, None], SECRET)
    masked, hidden, n = masked_forward(shared, engine, SECRET, cut)
    first, first_logits = run(engine, SECRET, text_drop=cut, max_tokens=2)
    assert first.usage.prefilled_tokens == n and first.usage.drop_skipped_tokens == 0   # cold: nothing skipped
    assert_same_logits(first_logits[:1], masked)
    _, plain_logits = run(new_engine(shared), SECRET, max_tokens=1)
    assert (plain_logits - masked).abs().max() > 1e-2   # the cut did matter
    again, again_logits = run(engine, SECRET, text_drop=cut, max_tokens=2)
    assert (again.usage.prefilled_tokens, again.usage.drop_skipped_tokens) == (1, hidden)
    assert again.usage.cached_tokens == n - 1 - hidden
    assert_same_logits(again_logits, first_logits)


def test_keep_text_drop_hides_what_the_kept_messages_leave_out(shared):
    engine = new_engine(shared)
    kept = [SECRET[0], {"role": "user", "content": "The secret code of the blue door"}, SECRET[3]]
    projection = project_kept(SECRET, kept)
    masked, hidden, n = masked_forward(shared, engine, projection.messages, projection.drop)
    assert hidden > 0
    # the full history was served before without drops: all of it is reused, only the header is new
    run(engine, SECRET, max_tokens=1)
    reused, reused_logits = run(engine, projection.messages, text_drop=projection.drop, max_tokens=2)
    assert reused.usage.prefilled_tokens < 10 and reused.usage.drop_skipped_tokens == hidden
    assert_same_logits(reused_logits[:1], masked)
    assert "4721" not in run(new_engine(shared), projection.messages, text_drop=projection.drop, max_tokens=14)[0].text


def test_a_self_drop_after_cached_repositions_equals_a_fresh_run(shared):
    """Found by a random search: a stage gathered freed KV (a message dropped at its own trigger,
    hidden from every row) and the forward indexed slot -1."""
    engine = new_engine(shared, kv_tokens=400)
    steps = [(1, {"3": [2, 3]}, None), (2, {"3": [2, 3], "5": [1]}, [4]), (3, {"3": [2, 3], "5": [1]}, [3, 4]),
             (4, {"3": [2, 3], "5": [1, 5]}, [3, 4, 7])]
    for turns, drops, repos in steps:
        _, logits = run(engine, agent(turns), drops, repos, max_tokens=2)
    _, fresh = run(new_engine(shared), agent(4), steps[-1][1], steps[-1][2], max_tokens=2)
    assert_same_logits(logits, fresh)
