"""What the sandbox's host view costs per command (a benchmark, not a test).

Runs the same commands in one sandbox per mechanism this machine offers, interleaved so that
the load of a shared machine falls on all alike: bubblewrap (own mount, pid, ipc and network
namespaces; the host read-only, secrets hidden, a private /tmp; `setpriv` to the command's
uid) against the fallback without it (a fresh uid and a network namespace only). Commands:
`true` (the start alone), `python -c pass`, and pytest on one test module of a localswe host
(isodate's `tests/test_date.py`, the kind of run a localswe build repeats for each candidate
bug; its archive is fetched into the data folder once and unpacked there).

    python benchmarks/sandbox.py [--runs 20] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import statistics
import time
from typing import Any, Callable

from benchmarks.common import format_table, ratio


def _isodate_tree() -> tuple[Any, Path]:
    from akv_core.home import akv_home
    from sandbox.suites.localswe.hosts import fetch, load_hosts, unpack

    host = next(h for h in load_hosts() if h.name == "isodate")
    root = akv_home() / "localswe"
    return host, unpack(host, fetch(host, root / "archives"), root / "trees")


def measure(runs: int = 20) -> dict[str, Any]:
    from sandbox.isolation.sandbox import Sandbox, containment, containments, unsafe_no_sandbox
    from sandbox.suites.localswe.testrun import run_pytest

    host, tree = _isodate_tree()
    # The mechanism without bubblewrap runs commands on the host: measured only where the user opted out.
    modes = [m for m in containments() if m.host == "bwrap" or unsafe_no_sandbox()] or [containment()]
    boxes = {mode.host: Sandbox.copy_of(tree, mode=mode) for mode in modes}
    commands: dict[str, Callable[[Sandbox], bool]] = {
        "true": lambda box: box.run(["true"]).returncode == 0,
        "python -c pass": lambda box: box.run([sys.executable, "-c", "pass"]).returncode == 0,
        "pytest tests/test_date.py": lambda box: run_pytest(box, host, ["tests/test_date.py"]).usable,
    }
    times: dict[tuple[str, str], list[float]] = {(c, m.host): [] for c in commands for m in modes}
    try:
        for _ in range(runs):
            for name, command in commands.items():
                for mode in modes:
                    started = time.perf_counter()
                    if not command(boxes[mode.host]):
                        raise RuntimeError(f"{name!r} failed in the {mode.host} sandbox")
                    times[(name, mode.host)].append(time.perf_counter() - started)
    finally:
        for box in boxes.values():
            box.close()
    medians = {f"{c} | {m}": round(statistics.median(t) * 1000, 1) for (c, m), t in times.items()}
    return {"runs": runs, "modes": [m.describe() for m in modes], "median_ms": medians}


def report(result: dict[str, Any]) -> str:
    hosts = [m.split("host: ")[1].split(" ")[0] for m in result["modes"]]
    commands = dict.fromkeys(key.split(" | ")[0] for key in result["median_ms"])
    rows = []
    for command in commands:
        ms = [result["median_ms"][f"{command} | {h}"] for h in hosts]
        extra = [f"{ms[0] - ms[1]:+.1f}", ratio(ms[0], ms[1])] if len(ms) == 2 else ["-", "-"]
        rows.append([command, *(f"{m:.1f}" for m in ms), *extra])
    header = ["command", *[f"{h} ms" for h in hosts], "extra ms", "ratio"]
    lines = [f"sandbox: median wall time per command over {result['runs']} interleaved runs",
             *[f"  {m}" for m in result["modes"]], "", format_table(header, rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command in each sandbox")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    result = measure(args.runs)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
