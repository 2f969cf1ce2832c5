"""The report's Pareto labels never overlap, measured in headless Chromium, and the lineage names
seeds, baselines and the proposer of every node."""
from __future__ import annotations

import json
import re

from test_evolve_run import chromium

from evolve.pareto import Point
from evolve.report import lineage_svg, pareto_svg
from store import PolicyInfo, ValidationRecord

MEASURE = """<pre id="boxes"></pre><script>
const boxes = [...document.querySelectorAll('#pareto text.label')].map(t => {
  const r = t.getBoundingClientRect(); return [t.textContent, r.left, r.top, r.right, r.bottom]; });
document.getElementById('boxes').textContent = JSON.stringify(boxes);
</script>"""


def record(label: str, score: float, cost: float, role: str = "candidate", champion: bool = False):
    return ValidationRecord(0, role, label, 8, score, cost, {}, True, champion, "")


def test_labels_of_coincident_and_crowded_points_do_not_intersect(tmp_path) -> None:
    heldout = [record("expert-8k", 0.5, 0.002, "baseline"), record("#30", 0.5, 0.002), record("#31", 0.5, 0.002),
               record("standard-8k", 0.5, 0.0021, "baseline"), record("full", 0.52, 0.0022, "baseline"),
               record("text-engineering-8k", 0.49, 0.0021, "baseline"), record("#7", 0.5, 0.00205, champion=True),
               record("#8", 0.3, 0.009)]
    train = [Point(i, 0.4 + i / 100, 0.002 + i / 10_000) for i in range(10)]
    page = tmp_path / "labels.html"
    page.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{pareto_svg(train, heldout)}{MEASURE}</body></html>",
                    encoding="utf-8")
    dom = chromium(page, "--dump-dom")
    boxes = json.loads(re.search(r'<pre id="boxes">(.*?)</pre>', dom, re.S).group(1))
    names = ", ".join(b[0] for b in boxes).split(", ")
    assert sorted(names) == sorted(v.label for v in heldout)  # every point named once
    assert next(b[0] for b in boxes if "#7" in b[0]).startswith("#7")  # the champion's name leads its spot
    for i, a in enumerate(boxes):
        assert a[3] - a[1] > 5 and a[4] - a[2] > 5  # really rendered
        for b in boxes[i + 1:]:
            assert not (a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]), f"{a} overlaps {b}"


def test_the_lineage_names_seeds_baselines_and_proposers() -> None:
    def info(pid: int, name: str | None, parents: tuple[int, ...] = (), proposer: str = "seed") -> PolicyInfo:
        return PolicyInfo(pid, 1, None, "mode kv", None, name, len(parents), proposer, "evaluated", None, parents,
                          0, 0, 0.0, {})

    svg = lineage_svg([info(1, "expert-8k"), info(2, "standard-8k", proposer="baseline"),
                       info(3, None, (1,), "mutate"), info(4, None, (3,), "optuna")], {3}, chain=[3, 1])
    nodes = re.findall(r'<text class="node"[^>]*>([^<]*)<tspan class="by"[^>]*> ([^<]*)</tspan></text>', svg)
    assert nodes == [("expert-8k", "seed"), ("standard-8k", "baseline"), ("#3", "mutate"), ("#4", "optuna")]
    assert svg.count('class="chain"') == 1  # the chosen policy's lineage: #3 from expert-8k, not #4 from #3
