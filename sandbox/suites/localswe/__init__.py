"""localswe: code-repair tasks in real Python projects, graded by their own tests.

Build: fetch the pinned host archives (hosts.json), unpack them, inject single-line bugs and
keep those the project's tests catch, split them, write a manifest. Run: each task opens in a
fresh sandboxed copy (sandbox.isolation.sandbox) with six tools; grading follows SWE-bench.
See docs/localswe.md.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from akv_core.home import akv_home
from sandbox.isolation.sandbox import Limits
from sandbox.suites.base import Agent, Task
from sandbox.suites.localswe.agent import ScriptedRepairAgent
from sandbox.suites.localswe.bugs import VALIDATION_VERSION, Bug, validated_bugs
from sandbox.suites.localswe.environment import TOOL_LIMITS, RepairEnv
from sandbox.suites.localswe.hosts import BuildError, Host, fetch, load_hosts, unpack
from sandbox.suites.localswe.tasks import SPLITS, make_task, split_of
from sandbox.suites.version import content_version, manifest_data

__all__ = ["LocalSWE", "BuildError"]

EDITIONS = (1, 2)
DEFAULT_EDITION = 2
# Per edition: validated bugs kept per host, and candidates validated per host at most.
SIZES = {1: (8, 40), 2: (8, 40)}


class LocalSWE:
    """The localswe suite (see sandbox.suites.base.Suite).

    Editions (a build parameter, recorded in the manifest): 1 is the first design (quiet test
    output, short tracebacks); 2, the default, has the realism of a real session: long test
    logs and tracebacks of which a few lines matter, files read and never edited, and repeated
    test runs whose older outputs are stale (docs/localswe.md).
    """

    name = "localswe"
    fresh_builds = True  # another seed injects other bugs, in any data folder (a fresh held-out: docs/evolve.md)

    def __init__(self, hosts: Sequence[str] | None = None, bugs_per_host: int | None = None,
                 max_tries: int | None = None, limits: Limits = TOOL_LIMITS, workers: int = 2):
        known = load_hosts()
        names = [h.name for h in known]
        unknown = sorted(set(hosts or ()) - set(names))
        if unknown:
            raise ValueError(f"unknown localswe host(s) {', '.join(unknown)}: expected some of {', '.join(names)}")
        self.hosts = [h for h in known if hosts is None or h.name in hosts]
        self._sizes = (bugs_per_host, max_tries)
        self.limits, self.workers = limits, workers
        self._home: Path | None = None
        self._edition: int | None = None

    # -- building ------------------------------------------------------------------------

    def config(self, seed: int, edition: int) -> dict[str, Any]:
        """Every build parameter of a build, as its manifest records it."""
        count, tries = (given or default for given, default in zip(self._sizes, SIZES[edition]))
        return {"edition": edition, "seed": seed, "hosts": [h.key for h in self.hosts],
                "bugs_per_host": count, "max_tries": tries, "validation": VALIDATION_VERSION}

    def build(self, home: Path, seed: int = 0, edition: int | None = None) -> None:
        """Build under `home`. `edition` None keeps the edition built there for these parameters
        (so runs after `akv tasks build --edition 1` stay on it), else builds the default one."""
        if edition is not None and edition not in EDITIONS:
            raise ValueError(f"unknown localswe edition {edition!r}: expected one of {', '.join(map(str, EDITIONS))}")
        root = Path(home) / "localswe"
        manifest = root / "manifest.json"
        self._home, self._edition = Path(home), None
        built = json.loads(manifest.read_text()).get("config") if manifest.exists() else None
        if edition is None:
            kept = built.get("edition", 1) if isinstance(built, dict) else None
            edition = kept if kept in EDITIONS and built == self.config(seed, kept) else DEFAULT_EDITION
        config = self.config(seed, edition)
        if built == config:
            return
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            found = dict(zip([h.key for h in self.hosts],
                             pool.map(lambda h: self._bugs_of(h, root, seed, config), self.hosts)))
        splits = split_of(self.hosts, found, seed)
        entries = [{"split": splits[bug.id], "bug": bug.to_json()} for key in sorted(found) for bug in found[key]]
        partial = manifest.with_suffix(".partial")
        partial.write_text(json.dumps({"config": config, "tasks": entries}, indent=1))
        partial.replace(manifest)  # written last: a reader never sees a half-written manifest

    def version(self, home: Path) -> str:
        """`localswe@eN-<12 hex>`: the manifest (build parameters and bugs) and the unpacked trees' archive digests."""
        root = Path(home) / "localswe"
        config = manifest_data(root / "manifest.json").get("config") or {}
        stamps = [root / "trees" / key / ".unpacked" for key in config.get("hosts", [])]
        return content_version(self.name, root / "manifest.json", stamps)

    @property
    def edition(self) -> int:
        """The edition of the build under the data folder (from its manifest)."""
        if self._edition is None:
            self._edition = int(self._manifest()["config"].get("edition", 1))
        return self._edition

    def _bugs_of(self, host: Host, root: Path, seed: int, config: dict[str, Any]) -> list[Bug]:
        archives = root / "archives"
        shared = akv_home() / "localswe" / "archives"  # a build in another folder (a fresh held-out) reuses them
        if not (archives / host.archive).exists() and (shared / host.archive).exists():
            archives = shared  # fetch checks the digest either way
        tree = unpack(host, fetch(host, archives), root / "trees")
        return validated_bugs(host, tree, root / "bugs", seed, config["bugs_per_host"], config["max_tries"])

    def _manifest(self) -> dict[str, Any]:
        manifest = self._root() / "manifest.json"
        if not manifest.exists():
            raise ValueError("the localswe suite is not built: run `akv tasks build --suite localswe`")
        return json.loads(manifest.read_text())

    # -- the Suite protocol --------------------------------------------------------------

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
        hosts = {h.key: h for h in load_hosts()}
        built = self._manifest()
        edition = int(built["config"].get("edition", 1))
        return [make_task(hosts[e["bug"]["host"]], Bug.from_json(e["bug"]), e["split"], edition)
                for e in built["tasks"] if e["split"] == split]

    def open(self, task: Task) -> RepairEnv:
        host = {h.key: h for h in load_hosts()}[task.meta["host"]]
        tree = self._root() / "trees" / host.key
        if not tree.is_dir():
            raise ValueError(f"the localswe tree of {host.key} is missing: run `akv tasks build --suite localswe`")
        return RepairEnv(task, host, tree, self.limits, _edition_of(task))

    def scripted_agent(self, task: Task) -> Agent:
        return ScriptedRepairAgent(task, _edition_of(task))

    def _root(self) -> Path:
        return (self._home or akv_home()) / "localswe"


def _edition_of(task: Task) -> int:
    return int(task.meta.get("edition", 1))
