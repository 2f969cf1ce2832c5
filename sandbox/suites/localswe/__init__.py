"""localswe: code-repair tasks in real Python projects, graded by their own tests.

Build: fetch the pinned host archives (hosts.json), unpack them, inject single-line bugs and
keep those the project's tests catch, split them, write a manifest. Run: each task opens in a
fresh sandboxed copy (sandbox.isolation) with six tools; grading follows SWE-bench.
See docs/localswe.md.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from akv_core.home import akv_home
from sandbox.isolation import Limits
from sandbox.suite import Agent, Task
from sandbox.suite_version import content_version, manifest_data
from sandbox.suites.localswe.agent import ScriptedRepairAgent
from sandbox.suites.localswe.bugs import Bug, validated_bugs
from sandbox.suites.localswe.environment import TOOL_LIMITS, RepairEnv
from sandbox.suites.localswe.hosts import BuildError, Host, fetch, load_hosts, unpack
from sandbox.suites.localswe.tasks import SPLITS, make_task, split_of

__all__ = ["LocalSWE", "BuildError"]

DEFAULT_BUGS_PER_HOST = 8
DEFAULT_MAX_TRIES = 40  # candidates validated per host before giving up on reaching the count


class LocalSWE:
    """The localswe suite (see sandbox.suite.Suite)."""

    name = "localswe"

    def __init__(self, hosts: Sequence[str] | None = None, bugs_per_host: int = DEFAULT_BUGS_PER_HOST,
                 max_tries: int = DEFAULT_MAX_TRIES, limits: Limits = TOOL_LIMITS, workers: int = 2):
        known = load_hosts()
        names = [h.name for h in known]
        unknown = sorted(set(hosts or ()) - set(names))
        if unknown:
            raise ValueError(f"unknown localswe host(s) {', '.join(unknown)}: expected some of {', '.join(names)}")
        self.hosts = [h for h in known if hosts is None or h.name in hosts]
        self.bugs_per_host, self.max_tries = bugs_per_host, max_tries
        self.limits, self.workers = limits, workers
        self._home: Path | None = None

    # -- building ------------------------------------------------------------------------

    def build(self, home: Path, seed: int = 0) -> None:
        root = Path(home) / "localswe"
        config = {"seed": seed, "hosts": [h.key for h in self.hosts],
                  "bugs_per_host": self.bugs_per_host, "max_tries": self.max_tries}
        manifest = root / "manifest.json"
        self._home = Path(home)
        if manifest.exists() and json.loads(manifest.read_text()).get("config") == config:
            return
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            found = dict(zip([h.key for h in self.hosts],
                             pool.map(lambda h: self._bugs_of(h, root, seed), self.hosts)))
        splits = split_of(self.hosts, found, seed)
        entries = [{"split": splits[bug.id], "bug": bug.to_json()} for key in sorted(found) for bug in found[key]]
        partial = manifest.with_suffix(".partial")
        partial.write_text(json.dumps({"config": config, "tasks": entries}, indent=1))
        partial.replace(manifest)  # a reader never sees a half-written manifest

    def version(self, home: Path) -> str:
        """`localswe@eN-<12 hex>`: the manifest (build parameters and bugs) and the unpacked trees' archive digests."""
        root = Path(home) / "localswe"
        config = manifest_data(root / "manifest.json").get("config") or {}
        stamps = [root / "trees" / key / ".unpacked" for key in config.get("hosts", [])]
        return content_version(self.name, root / "manifest.json", stamps)

    def _bugs_of(self, host: Host, root: Path, seed: int) -> list[Bug]:
        tree = unpack(host, fetch(host, root / "archives"), root / "trees")
        return validated_bugs(host, tree, root / "bugs", seed, self.bugs_per_host, self.max_tries)

    # -- the Suite protocol --------------------------------------------------------------

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
        manifest = self._root() / "manifest.json"
        if not manifest.exists():
            raise ValueError("the localswe suite is not built: run `akv tasks build --suite localswe`")
        hosts = {h.key: h for h in load_hosts()}
        entries = json.loads(manifest.read_text())["tasks"]
        return [make_task(hosts[e["bug"]["host"]], Bug.from_json(e["bug"]), e["split"])
                for e in entries if e["split"] == split]

    def open(self, task: Task) -> RepairEnv:
        host = {h.key: h for h in load_hosts()}[task.meta["host"]]
        tree = self._root() / "trees" / host.key
        if not tree.is_dir():
            raise ValueError(f"the localswe tree of {host.key} is missing: run `akv tasks build --suite localswe`")
        return RepairEnv(task, host, tree, self.limits)

    def scripted_agent(self, task: Task) -> Agent:
        return ScriptedRepairAgent(task)

    def _root(self) -> Path:
        return (self._home or akv_home()) / "localswe"
