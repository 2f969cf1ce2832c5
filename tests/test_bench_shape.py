"""benchmarks/shape.py on a constructed trajectory: arrivals, last reads, repeats and edited files."""
from __future__ import annotations

import json

from benchmarks.shape import _outputs, summarize


class Chars:
    def count(self, message) -> int:
        return len(message.get("content") or "")


def turn(call_id: str, name: str, args: dict, result: str) -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


def test_outputs_know_when_they_arrived_were_last_read_and_were_repeated() -> None:
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    history += turn("a", "run_tests", {"selector": "t"}, "x" * 40)            # 3: read at steps 1 and 3
    history += turn("b", "read_file", {"path": "m.py", "start": 1}, "y" * 20)  # 5: read on arrival only
    history += turn("c", "edit", {"path": "m.py", "old": "a", "new": "b"}, "Edited m.py.")  # 7
    history += turn("d", "run_tests", {"selector": "t"}, "z" * 40)            # 9: the same call again
    steps = [(2, {1}), (4, {1, 3}), (6, {5}), (8, {3, 7}), (10, {9})]
    outputs = _outputs("t1", history, steps, Chars())
    assert [(o.tool, o.arrived, o.last_read, o.superseded) for o in outputs] == [
        ("run_tests", 1, 3, True), ("read_file", 2, 2, False), ("edit", 3, 3, False), ("run_tests", 4, 4, False)]
    assert outputs[1].edited_file is True and outputs[0].edited_file is None
    shape = summarize(outputs, n_tasks=1)
    assert shape["tools"]["run_tests"]["per_task"] == 2 and shape["tools"]["run_tests"]["superseded"] == 0.5
    assert shape["token_share_read_on_arrival_only"] == (20 + 12 + 40) / (40 + 20 + 12 + 40)
    assert shape["long_range_share"] == 0.0  # nothing read ten steps after it arrived
