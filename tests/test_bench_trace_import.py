"""benchmarks/trace_import.py on a few runs: the copies are distinct runs, each import is a real
`akv traces import` whose peak memory the kernel reports, and the table shows them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import trace_import

DATA = Path(__file__).parent / "data" / "traces"


def test_copies_are_distinct_runs_and_each_import_is_measured(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("mswea.traj.json", "mswea-v2.traj.json"):
        shutil.copy(DATA / name, source / name)
    made = trace_import.make_runs(sorted(source.glob("*.traj.json")), 3, tmp_path)
    ids = [json.loads(p.read_text())["instance_id"] for p in made]
    assert len(set(ids)) == 3 and ids[0].endswith("-copy0000")
    result = trace_import.measure(source, runs=4)
    rows = result["imports"]
    assert [r["runs"] for r in rows.values()] == [1, 1, 4]
    assert rows["4 runs"]["summary"].startswith("bench2: 4 traces added, 0 unchanged")
    assert all(r["peak_mb"] > 10 and r["seconds"] > 0 for r in rows.values())
    assert "peak vs largest run alone" in trace_import.report(result)
