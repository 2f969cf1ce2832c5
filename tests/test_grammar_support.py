"""Grammars exercised without a model: a one-byte-per-token tokenizer and seeded random walks.

A walk samples uniformly among the bytes llguidance allows next, so it reaches every corner of a
grammar's language (long numbers, odd strings, deep and/or chains), not only what a model would
write. This module holds no tests.
"""
from __future__ import annotations

import random
from functools import lru_cache

import llguidance
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS = 256


@lru_cache(maxsize=1)
def byte_tokenizer() -> llguidance.LLTokenizer:
    """Tokens 0..255 are the bytes (GPT-2's byte-to-character map), 256 is EOS."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": EOS}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=EOS + 1, eos_token=EOS)


def _byte_of(char: str) -> int:
    """GPT-2's map: printable bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def matcher(grammar_lark: str) -> llguidance.LLMatcher:
    """A fresh matcher (a copy of one compiled once per grammar)."""
    return _compiled(grammar_lark).deep_copy()


@lru_cache(maxsize=8)
def _compiled(grammar_lark: str) -> llguidance.LLMatcher:
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar_lark)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, byte_tokenizer())
    assert not failed, messages
    return llguidance.LLMatcher(byte_tokenizer(), compiled, log_level=0)


def accepts(grammar_lark: str, text: str) -> bool:
    m = matcher(grammar_lark)
    return m.consume_tokens(list(text.encode("utf-8"))) and m.is_accepting()


def random_walk(m: llguidance.LLMatcher, rng: random.Random, stop_chance: float = 0.2,
                max_bytes: int = 2000) -> str | None:
    """A text the grammar accepts, chosen byte by byte; None if it had not ended by max_bytes."""
    bits = np.empty((EOS + 1 + 31) // 32, dtype=np.int32)
    out = bytearray()
    while len(out) < max_bytes:
        if m.is_stopped() or (m.is_accepting() and rng.random() < stop_chance):
            return out.decode("utf-8")
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:EOS])
        if len(allowed) == 0:
            return out.decode("utf-8") if m.is_accepting() else None
        byte = int(allowed[rng.randrange(len(allowed))])
        assert m.consume_token(byte), m.get_error()
        out.append(byte)
    return None
