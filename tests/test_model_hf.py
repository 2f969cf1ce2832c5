"""Hugging Face safetensors folders: tiny random Llama, Qwen2 and Qwen3 models made by transformers itself."""
from __future__ import annotations

import json

import pytest
import torch

from akv_core.chat import ChatTokenizer
from akv_core.model.batch import ForwardBatch, SeqAttention
from akv_core.model.loader import load_model

TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)


def make_folder(kind: str, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    torch.manual_seed(0)
    if kind == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope, tie_word_embeddings=False))
    elif kind == "qwen2":
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e6}
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, rope_parameters=rope, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32, rope_parameters={"rope_type": "linear",
                                             "factor": 2.0, "rope_theta": 10000.0}))
    with torch.no_grad():  # random norms and biases, so that skipping one would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(1000)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "t2"}))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_safetensors_logits_match_transformers(kind, tmp_path):
    torch.set_num_threads(1)
    reference = make_folder(kind, tmp_path)
    model = load_model(str(tmp_path))
    assert model.config.architecture == kind
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(600, 640)  # past the original context: the scaling matters
    with torch.no_grad():
        expected = reference(ids[None], position_ids=positions[None]).logits[0]
    kv = model.new_kv_buffers(64)
    slots = torch.arange(40)
    ours = model.forward(ForwardBatch(ids[:37], positions[:37], slots[:37], [SeqAttention(0, 37, slots[:37])],
                                      torch.arange(37)), kv)
    for step in range(37, 40):  # three decode steps over the pool
        ours = torch.cat([ours, model.forward(ForwardBatch(ids[step:step + 1], positions[step:step + 1],
                                                           slots[step:step + 1],
                                                           [SeqAttention(0, 1, slots[:step + 1])],
                                                           torch.tensor([0])), kv)])
    assert (ours - expected).abs().max() < 1e-4


def test_folder_chat_template_renders_native_tools(tmp_path):
    make_folder("qwen3", tmp_path)
    chat = ChatTokenizer.from_model(str(tmp_path))
    assert chat.native_tools and chat.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    rendered = chat.render(messages, tools=tools)
    assert list(rendered.token_ids) == chat.encode(chat.render_text(messages, tools=tools))
    assert len(rendered.spans) == 2 and rendered.spans[1][1] == rendered.header_start


def test_unsupported_architecture_is_named(tmp_path):
    make_folder("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_model(str(tmp_path))
