"""validate_operations: what the server turns into a 400 naming the field."""
from __future__ import annotations

import pytest

from akv_core.cache.ops import OperationError, Operations, validate_operations


def test_valid_fields_are_normalised():
    ops = validate_operations(6, {"5": [2, 1], 3: [0]}, [5, 3])
    assert ops == Operations(drops=((3, (0,)), (5, (1, 2))), repositions=(3, 5))


def test_nothing_is_empty():
    assert validate_operations(3, None, None).empty
    assert validate_operations(3, {}, []).empty


def test_thinking_drop_is_an_operation_of_its_own_never_with_drop_message():
    ops = validate_operations(4, None, [3], thinking_drop=True)
    assert ops == Operations(drops=(), repositions=(3,), thinking_drop=True) and not ops.empty
    assert not validate_operations(4, None, None, thinking_drop=True).empty
    for drop_message in ({"3": [1]}, {}):
        with pytest.raises(OperationError) as caught:
            validate_operations(4, drop_message, None, thinking_drop=True)
        assert caught.value.field == "drop_rule" and "not both" in str(caught.value)
    with pytest.raises(OperationError) as caught:
        validate_operations(4, None, None, thinking_drop="yes")
    assert caught.value.field == "drop_rule"


def test_a_trigger_may_drop_itself_as_upstream_allows():
    assert validate_operations(6, {"3": [3, 1]}, [3]).drops == ((3, (1, 3)),)


@pytest.mark.parametrize("drop_message, reposition, field", [
    ({"x": [1]}, None, "drop_message.x"),
    ({"1.5": [0]}, None, "drop_message.1.5"),
    ({"3": ["1"]}, None, "drop_message.3[0]"),
    ({"3": [True]}, None, "drop_message.3[0]"),
    ({"3": [1.0]}, None, "drop_message.3[0]"),
    ({"9": [1]}, None, "drop_message.9"),
    ({"-1": [0]}, None, "drop_message.-1"),
    ({"3": [7]}, None, "drop_message.3[0]"),
    ({"2": [3]}, None, "drop_message.2[0]"),
    ({"3": [1, 1]}, None, "drop_message.3[1]"),
    ({"3": [1], "4": [1]}, None, "drop_message.4[0]"),
    ({"3": [1], 3: [2]}, None, "drop_message.3"),
    ({"3": 1}, None, "drop_message.3"),
    ([1, 2], None, "drop_message"),
    (None, [6], "reposition[0]"),
    (None, [1, "2"], "reposition[1]"),
    (None, [2, 2], "reposition[1]"),
    (None, "3", "reposition"),
])
def test_invalid_fields_name_the_field(drop_message, reposition, field):
    with pytest.raises(OperationError) as caught:
        validate_operations(6, drop_message, reposition)
    assert caught.value.field == field
    assert str(caught.value).startswith(field + ": ")
    assert "\n" not in str(caught.value)
