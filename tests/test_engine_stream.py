"""Streaming text: deltas add up to the text, stop strings end it and never leak out in part."""
from __future__ import annotations

import pytest

from akv_core.chat import ChatTokenizer
from akv_core.request import StreamText

pytestmark = pytest.mark.model   # the real tokenizer from the GGUF file


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_model("smollm2")


def feed_all(stream: StreamText, ids: list[int]) -> list[str]:
    deltas = []
    for token in ids:
        deltas.append(stream.feed(token))
        if stream.stopped:
            break
    deltas.append(stream.flush())
    return deltas


def test_deltas_concatenate_to_the_decoded_text(tokenizer):
    text = "Grüße aus Köln: 東京 → 4721 🚪 done."
    ids = tokenizer.encode(text)
    deltas = feed_all(StreamText(tokenizer.decode, ()), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)   # never half a character


def test_a_stop_string_ends_the_text_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("The code is 4721. The blue door opens. More text follows.")
    stream = StreamText(tokenizer.decode, ("blue door", "never"))
    deltas = feed_all(stream, ids)
    assert stream.stopped
    assert "".join(deltas) == "The code is 4721. The "
    assert not any("blue" in d for d in deltas)


def test_text_that_only_starts_a_stop_string_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("Open the blue")
    stream = StreamText(tokenizer.decode, ("blue door",))
    deltas = feed_all(stream, ids)
    assert not stream.stopped
    assert "".join(deltas[:-1]) == "Open the " and deltas[-1] == "blue"
