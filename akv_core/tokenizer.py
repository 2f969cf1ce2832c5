"""Token ids exactly as the model was trained with, built from the model's own files.

A GGUF file carries no tokenizer.json: its vocabulary, merges and token types
are metadata under llama.cpp's key names. We rebuild a `tokenizers` byte-level
BPE from them (the same construction transformers uses, so ids agree) and keep
the result as tokenizer.json in the data folder, because reading 49K strings
out of the GGUF takes seconds while loading the JSON takes milliseconds.
Hugging Face folders bring their tokenizer.json and tokenizer_config.json.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from akv_core.home import data_path
from akv_core.model.locate import ModelFiles

# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Split rules for `tokenizer.ggml.pre` values whose merges were learned on a custom split
# (others, `smollm` included, use GPT-2's own byte-level regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
               "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@dataclass(frozen=True)
class TokenizerFiles:
    """What the chat layer needs besides the BPE itself."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token_ids: tuple[int, ...]


def load_tokenizer_files(files: ModelFiles) -> TokenizerFiles:
    """Build (or load from the data folder) the tokenizer of a located model."""
    if files.kind == "gguf":
        return _from_gguf_cached(files)
    return _from_hf_folder(files.path)


def _from_gguf_cached(files: ModelFiles) -> TokenizerFiles:
    cache = data_path("tokenizers", files.cache_key + ".json")
    if not cache.is_file():
        tokenizer, meta = _build_from_gguf(files.path)
        payload = {"meta": meta, "tokenizer": json.loads(tokenizer.to_str())}
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        tmp.replace(cache)  # atomic: a concurrent reader never sees half a file
    payload = json.loads(cache.read_text(encoding="utf-8"))
    meta = payload["meta"]
    return TokenizerFiles(Tokenizer.from_str(json.dumps(payload["tokenizer"])), meta["chat_template"],
                          meta["bos_token"], tuple(meta["eos_token_ids"]))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def _build_from_gguf(path: Path) -> tuple[Tokenizer, dict]:
    import gguf  # the reader is only needed the first time

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        entry = reader.fields.get(key)
        return default if entry is None else entry.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {kind!r} is not supported (expected a byte-level 'gpt2' BPE)")
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet is respelled byte by byte (as transformers does).
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS.get(field("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) must match whole, never be cut into bytes.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    bos = field("tokenizer.ggml.bos_token_id")
    eos = field("tokenizer.ggml.eos_token_id")
    eot = field("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    meta = {"chat_template": field("tokenizer.chat_template"),
            "bos_token": tokens[bos] if bos is not None else None, "eos_token_ids": list(eos_ids)}
    return tokenizer, meta


def _from_hf_folder(folder: Path) -> TokenizerFiles:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = _read_json(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    eos_ids: list[int] = []
    for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
        value = source.get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value] if value is not None else []
    eos_token = config.get("eos_token")
    eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    if eos_token and tokenizer.token_to_id(eos_token) is not None:
        eos_ids.append(tokenizer.token_to_id(eos_token))
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    return TokenizerFiles(tokenizer, template, bos, tuple(dict.fromkeys(eos_ids)))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
