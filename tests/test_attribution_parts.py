"""The parts of attribution that need no model: which prompt tokens a reply sees, which message each
belongs to, and the shares adding up (the model-backed checks are in test_attribution.py)."""
from __future__ import annotations

from array import array

import pytest

from akv_core.attribution import USED_MASS, Attribution, KeyProvenance, MessageMass, attribute
from akv_core.cache.key import REPOS, CacheKey, DropRecord
from akv_core.forcing import visible_offsets


def test_visible_offsets_leave_out_every_hidden_token_once() -> None:
    key = CacheKey(array("i", range(20)), ((6, DropRecord(((2, 4),))), (6, REPOS),
                                           (12, DropRecord(((3, 5), (8, 10))))))
    assert visible_offsets(key) == [0, 1, 5, 6, 7, *range(10, 20)]   # [2, 4) and [3, 5) overlap
    assert visible_offsets(CacheKey(array("i", range(3)), ())) == [0, 1, 2]


def test_tokens_map_to_their_message_or_the_header() -> None:
    provenance = KeyProvenance(((0, 4), (4, 9), (9, 12)), header_start=12)
    assert [provenance.message_of(offset) for offset in (0, 3, 4, 8, 9, 11, 12, 14)] == [0, 0, 1, 1, 2, 2, None, None]


def test_shares_are_split_by_message_and_dropped_ones_stay_listed() -> None:
    provenance = KeyProvenance(((0, 4), (4, 9), (9, 12)), header_start=12)
    offsets = [0, 1, 2, 3, 9, 10, 11, 12, 13]          # message 1 is dropped
    masses = [0.2, 0.05, 0.05, 0.0, 0.1, 0.05, 0.05, 0.1, 0.1]
    result = attribute(provenance, offsets, masses, 0.0, 0.3, tokens=5)
    assert result.messages == (MessageMass(0, pytest.approx(0.3), 4), MessageMass(1, 0.0, 0),
                               MessageMass(2, pytest.approx(0.2), 3))
    assert result.generation_header == pytest.approx(0.2) and result.reply == 0.3 and result.tokens == 5
    assert result.used() == (0, 2) and result.used(0.25) == (0,) and 0 < USED_MASS < 1
    assert Attribution.from_dict(result.to_dict()) == result
    with pytest.raises(ValueError):
        attribute(provenance, offsets, masses[:-1], 0.0, 0.3, tokens=5)   # not aligned
