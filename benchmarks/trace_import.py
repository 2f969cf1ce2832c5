"""How `akv traces import` scales: time and peak memory of importing many runs (a benchmark, not a test).

Makes N mini-swe-agent runs in a temporary folder by copying the `.traj.json` files of `--source`
round-robin, each copy a run of its own (a new `instance_id`, the task message marked with its
number, so no two are the same run), then imports the largest run alone, a tenth of the runs and all
of them, each in a fresh database, each by a fresh `akv traces import` process, and reads the
process's peak resident memory from the kernel (`wait4`). An import that holds one file at a time
peaks at about the same memory for one run, a tenth and all of them; one that held every trace
would grow with the total.

    python -m benchmarks.trace_import --source DIR [--runs 500] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import subprocess
import tempfile
import time
from typing import Any, Sequence

from benchmarks.common import format_table, ratio

ROOT = Path(__file__).resolve().parents[1]


def make_runs(sources: Sequence[Path], runs: int, folder: Path) -> list[Path]:
    """`runs` copies of the source trajectories in `folder`, each a distinct run."""
    made = []
    for n in range(runs):
        source = sources[n % len(sources)]
        doc = json.loads(source.read_text(encoding="utf-8"))
        own = doc.get("instance_id") or source.name.split(".")[0]
        doc["instance_id"] = f"{own}-copy{n:04d}"
        task = next(m for m in doc["messages"] if m.get("role") == "user")
        task["content"] = f"{task['content']}\n(copy {n})"
        path = folder / f"{doc['instance_id']}.traj.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        made.append(path)
    return made


def import_once(files: Sequence[Path], folder: Path, name: str) -> dict[str, Any]:
    """One `akv traces import` of `files` into a fresh database: seconds, peak memory, its summary line."""
    env = {**os.environ, "AKV_HOME": str(folder / "home"), "AKV_DB": f"sqlite:///{folder / (name + '.db')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = folder / f"{name}.log"
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "akv_cli.main", "traces", "import", *map(str, files),
                                    "--name", name], env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)  # reaped here, so its usage is this process's alone
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"akv traces import failed: {log.read_text().strip()}")
    return {"runs": len(files), "mb": sum(f.stat().st_size for f in files) / 1e6, "seconds": seconds,
            "peak_mb": usage.ru_maxrss / 1024, "summary": log.read_text().strip().splitlines()[-1]}


def measure(source: Path, runs: int = 500) -> dict[str, Any]:
    sources = sorted(source.glob("*.traj.json"))
    if not sources:
        raise SystemExit(f"--source: no .traj.json files in {source}")
    with tempfile.TemporaryDirectory(prefix="akv-import-") as tmp:
        folder = Path(tmp)
        (folder / "runs").mkdir()
        files = make_runs(sources, runs, folder / "runs")
        largest = max(files, key=lambda f: f.stat().st_size)
        largest_mb = largest.stat().st_size / 1e6
        sizes = {"largest run": [largest], f"{max(1, runs // 10)} runs": files[:max(1, runs // 10)],
                 f"{runs} runs": files}
        rows = {label: import_once(chosen, folder, f"bench{n}") for n, (label, chosen) in enumerate(sizes.items())}
    return {"source": str(source), "source_files": len(sources), "largest_run_mb": largest_mb,
            "imports": rows}


def report(result: dict[str, Any]) -> str:
    imports = result["imports"]
    first = next(iter(imports.values()))
    rows = [[label, r["runs"], f"{r['mb']:.1f}", f"{r['seconds']:.1f}", f"{r['mb'] / r['seconds']:.1f}",
             f"{r['peak_mb']:.0f}", ratio(r["peak_mb"], first["peak_mb"])] for label, r in imports.items()]
    header = ["import", "runs", "MB", "s", "MB/s", "peak MB", "peak vs largest run alone"]
    return "\n".join([f"akv traces import: copies of {result['source_files']} mini-swe-agent runs "
                      f"(largest run {result['largest_run_mb']:.2f} MB), each import a fresh process and database",
                      "", format_table(header, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a folder of mini-swe-agent .traj.json files")
    parser.add_argument("--runs", type=int, default=500, help="runs to make and import (default 500)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    result = measure(args.source, args.runs)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
