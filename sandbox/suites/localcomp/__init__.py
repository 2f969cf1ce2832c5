"""localcomp: offline deep research in miniature (BrowseComp-Plus style) over a built corpus.

`LocalComp().build(home, seed)` extracts facts from PyPI-shipped data, renders a few thousand
articles, indexes them for BM25 search and generates the questions; everything lands under
`home/localcomp`. See docs/localcomp.md.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from sandbox.suite import Task
from sandbox.suite_version import content_version
from sandbox.suites.localcomp.agent import ScriptedAgent
from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.corpus import Corpus, render_corpus, write_index
from sandbox.suites.localcomp.env import TOOLS, LocalCompEnv
from sandbox.suites.localcomp.facts import FACTS_VERSION, Facts, extract_facts
from sandbox.suites.localcomp.tasks import QUOTA, SPLITS, drafts, make_task
from sandbox.suites.localcomp.walkthrough import trajectory_tokens, walk

BUILD_VERSION = 6
TRAJECTORY_TOKENS = (10_000, 30_000)  # a full scripted trajectory must land in this range


class LocalComp:
    name = "localcomp"

    def __init__(self, home: Path | None = None, quota: Mapping[str, int] | None = None):
        """`quota` caps the tasks per split (default: 48 train, 170 heldout); tests build less."""
        self._home = home
        self._quota = dict(quota or QUOTA)
        self._tasks: dict[str, list[Task]] | None = None
        self._corpus: Corpus | None = None

    # -- building -----------------------------------------------------------------------------
    def build(self, home: Path, seed: int = 0) -> None:
        """Create corpus and tasks under home/localcomp; a no-op when this seed is already built."""
        self._home, self._tasks = Path(home), None
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        manifest = {"version": BUILD_VERSION, "seed": seed, "quota": self._quota}
        if _read_json(root / "build.json") == manifest and (root / "corpus.sqlite").exists() \
                and (root / "tasks.json").exists():
            return
        self.close()
        atlas = Atlas(_facts(root))
        index = root / f"corpus.sqlite.{os.getpid()}.tmp"
        index.unlink(missing_ok=True)
        write_index(render_corpus(atlas, seed), index)
        corpus = Corpus(index)
        try:
            tasks = _generate(atlas, corpus, seed, self._quota)
        finally:
            corpus.close()
        os.replace(index, root / "corpus.sqlite")
        _write_json(root / "tasks.json", [_task_json(t) for t in tasks])
        _write_json(root / "build.json", manifest)

    def version(self, home: Path) -> str:
        """`localcomp@eN-<12 hex>` of the data built under home (SuiteNotBuilt when missing)."""
        root = Path(home) / "localcomp"
        return content_version(self.name, root / "build.json", [root / "tasks.json", root / "corpus.sqlite"])

    @property
    def root(self) -> Path:
        if self._home is None:
            from akv_core.home import akv_home

            self._home = akv_home()
        return self._home / "localcomp"

    # -- using --------------------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for localcomp: expected one of {', '.join(SPLITS)}")
        if self._tasks is None:
            path = self.root / "tasks.json"
            if not path.exists():
                raise ValueError("localcomp is not built yet: run `akv tasks build --suite localcomp`")
            try:
                loaded = [_task_from_json(t) for t in json.loads(path.read_text(encoding="utf-8"))]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path} is damaged ({err}): "
                                 "rebuild with `akv tasks build --suite localcomp`") from None
            self._tasks = {s: [t for t in loaded if t.split == s] for s in SPLITS}
        return list(self._tasks[split])

    def open(self, task: Task) -> LocalCompEnv:
        if self._corpus is None:
            path = self.root / "corpus.sqlite"
            if not path.exists():
                raise ValueError("localcomp is not built yet: run `akv tasks build --suite localcomp`")
            self._corpus = Corpus(path)
        return LocalCompEnv(self._corpus, task)

    def scripted_agent(self, task: Task) -> ScriptedAgent:
        return ScriptedAgent(task)

    def close(self) -> None:
        if self._corpus is not None:
            self._corpus.close()
            self._corpus = None


def _facts(root: Path) -> Facts:
    """Facts are the same for every seed: extract once (mendeleev loads slowly), then reuse."""
    path = root / f"facts.v{FACTS_VERSION}.json"
    if path.exists():
        return Facts.from_json(json.loads(path.read_text(encoding="utf-8")))
    facts = extract_facts()
    _write_json(path, facts.to_json())
    return facts


def _generate(atlas: Atlas, corpus: Corpus, seed: int, quota: Mapping[str, int]) -> list[Task]:
    """Drafts in seeded order; a draft becomes a task when the scripted agent, seeing everything,
    reaches the gold answer with a trajectory of the intended length."""
    count = {s: 0 for s in SPLITS}
    tasks = []
    for draft in drafts(atlas, seed):
        if count[draft.split] >= quota[draft.split]:
            if all(count[s] >= quota[s] for s in SPLITS):
                break
            continue
        task = make_task(draft, count[draft.split], corpus.docid_of)
        env = LocalCompEnv(corpus, task)
        run = walk(task, env, ScriptedAgent(task))
        tokens = trajectory_tokens(task, run.messages)
        if env.grade(run.answer).score < 1.0 or not TRAJECTORY_TOKENS[0] <= tokens <= TRAJECTORY_TOKENS[1]:
            continue
        meta = {**task.meta, "hard_negatives": _hard_negatives(run.messages, set(task.meta["gold_docs"])),
                "reference_tokens": tokens, "reference_steps": run.steps}
        tasks.append(Task(task.id, task.suite, task.split, task.system, task.prompt, task.tools, meta))
        count[draft.split] += 1
    return tasks


def _hard_negatives(messages: tuple[dict[str, Any], ...], gold: set[str]) -> list[str]:
    """Documents the research met before the right one: hits ranked above a gold document in a
    search the plan made, and documents opened and ruled out."""
    out: set[str] = set()
    for m in messages:
        if m.get("role") == "tool" and m["content"].startswith("[{"):
            hits = [h["docid"] for h in json.loads(m["content"])]
            first_gold = next((i for i, d in enumerate(hits) if d in gold), len(hits))
            out.update(hits[:first_gold])
        elif m.get("role") == "assistant":
            out.update(re.findall(r"^Ruled out: .+ \[(lc-\d{5})\]$", m.get("content") or "", re.MULTILINE))
    return sorted(out - gold)


def _task_json(task: Task) -> dict[str, Any]:
    return {"id": task.id, "split": task.split, "system": task.system, "prompt": task.prompt,
            "meta": dict(task.meta)}


def _task_from_json(data: dict[str, Any]) -> Task:
    return Task(id=data["id"], suite="localcomp", split=data["split"], system=data["system"],
                prompt=data["prompt"], tools=TOOLS, meta=data["meta"])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
