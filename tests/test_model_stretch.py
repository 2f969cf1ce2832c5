"""The embedded model served past its trained 8K context with its RoPE stretched (YaRN x4 to 32K).

What is checked: settings are refused with the field they came from; the stretched config's
rotation is transformers' YaRN for the same rope_scaling block; the stretched engine reports its
context, generates, and the server's admission accepts a prompt past 8K positions (queued, then
cancelled: a 9K-token prefill takes minutes on the test machine, so no forward runs beyond 8K here).
"""
from __future__ import annotations

import pytest
import torch

from akv_core.model.loader import model_config
from akv_core.model.rope import Rope
from akv_core.model.stretch import stretch

TRAINED = 8192


@pytest.mark.parametrize("context, scaling, expected", [
    (32768, None, "context_length: 32768 is beyond the model's trained context of 8192"),
    (32768, "yarn:2", "rope_scaling: yarn:2 stretches the trained 8192 tokens to 16384, fewer than"),
    (None, "yarn", "rope_scaling: 'yarn' without a factor needs a context_length beyond"),
    (32768, "cubic", "rope_scaling: unknown scaling 'cubic'"),
    (32768, "yarn:four", "rope_scaling: the factor in 'yarn:four' is not a number"),
    (32768, "yarn:0.5", "rope_scaling: the factor in 'yarn:0.5' must be a number above 1"),
    (None, "none:2", "rope_scaling: 'none:2' takes no factor"),
    (0, None, "context_length: expected a positive number of tokens, got 0"),
])
def test_a_bad_stretch_names_its_field(context, scaling, expected) -> None:
    with pytest.raises(ValueError) as error:
        stretch(model_config("smollm2"), context, scaling)
    assert expected in str(error.value)


def test_the_cli_names_its_options() -> None:
    with pytest.raises(ValueError, match=r"^--rope-scaling: yarn:2 stretches"):
        stretch(model_config("smollm2"), 32768, "yarn:2", fields=("--context", "--rope-scaling"))


def test_yarn_x4_of_the_embedded_model_is_transformers_yarn() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    trained = model_config("smollm2")
    assert trained.context_length == TRAINED and trained.rope_scaling.kind == "default"
    config = stretch(trained, 32768, "yarn")
    assert config == stretch(trained, None, "yarn:4")
    assert (config.context_length, config.rope_scaling.kind, config.rope_scaling.factor,
            config.rope_scaling.original_context_length) == (32768, "yarn", 4.0, TRAINED)
    assert stretch(trained, 4096) .context_length == 4096 and stretch(trained, 4096).rope_scaling.kind == "default"
    reference = LlamaRotaryEmbedding(LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads, head_dim=config.head_dim,
        max_position_embeddings=32768, rope_theta=config.rope_theta,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAINED}))
    rope = Rope(config)
    assert torch.equal(rope.inv_freq, reference.inv_freq)
    assert rope.attention_scaling == pytest.approx(reference.attention_scaling)
    assert rope._cos_table.shape[0] == 32768   # positions past 8K come from the table, as below it
    assert not torch.equal(rope.inv_freq, Rope(trained).inv_freq)


@pytest.mark.model
def test_the_stretched_engine_serves_its_context_and_admits_a_prompt_past_8k() -> None:
    from akv_core import Engine
    from akv_core.server.engine_loop import EngineLoop, prompt_end_position
    from akv_core.server.validation import GenerationArgs

    torch.set_num_threads(1)
    engine = Engine.from_pretrained("smollm2", device="cpu", kv_tokens=10_240, context_length=32768,
                                    rope_scaling="yarn")
    assert engine.context_length == 32768 and engine.model.config.rope_scaling.factor == 4.0
    short = engine.generate([{"role": "user", "content": "Hello"}], max_tokens=2)
    assert len(short.token_ids) == 2
    long_prompt = [{"role": "user", "content": "word " * 9000}]
    args = GenerationArgs(messages=long_prompt, tools=None, drop_message=None, reposition=None,
                          thinking_drop=False, max_tokens=1, temperature=0.0, top_p=1.0, seed=None, stop=None)
    assert prompt_end_position(engine, args) > TRAINED
    handle = EngineLoop(engine).submit(args)   # raises APIError (context_length_exceeded) at 8K
    handle.cancel()
    engine.step()
    assert handle.done
    engine.check_integrity()
