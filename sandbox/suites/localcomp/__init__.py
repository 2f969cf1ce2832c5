"""localcomp: offline deep research in miniature (BrowseComp-Plus style) over a built corpus.

`LocalComp().build(home, seed)` extracts facts from PyPI-shipped data, renders a few thousand
articles, indexes them for BM25 search and generates the questions; everything lands under
`home/localcomp`. See docs/localcomp.md.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from sandbox.suites.base import Task
from sandbox.suites.version import content_version
from sandbox.suites.localcomp.agent import ScriptedAgent
from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.corpus import Corpus, render_corpus, write_index
from sandbox.suites.localcomp.context import read_context, read_search_page
from sandbox.suites.localcomp.env import LocalCompEnv, tools_of
from sandbox.suites.localcomp.facts import FACTS_VERSION, Facts, extract_facts
from sandbox.suites.localcomp.summary import summary_facts
from sandbox.suites.localcomp.tasks import QUOTA, SPLITS, drafts, make_task
from sandbox.suites.localcomp.walkthrough import trajectory_tokens, walk

@dataclass(frozen=True)
class Design:
    """What a question of an edition must show when the scripted agent researches it seeing everything."""

    version: int  # bumped when the edition's output changes
    trajectory_tokens: tuple[int, int]  # the final prompt's length must land in this range
    min_dead_ends: int  # documents opened and ruled out


EDITIONS = {  # generator designs: 1 = the first one (kept reproducible), 2 = realistic trajectories
    1: Design(version=6, trajectory_tokens=(10_000, 30_000), min_dead_ends=0),
    2: Design(version=1, trajectory_tokens=(12_000, 40_000), min_dead_ends=2),
}
DEFAULT_EDITION = 2


class LocalComp:
    name = "localcomp"
    fresh_builds = True  # another seed builds other tasks, in any data folder (a fresh held-out: docs/evolve.md)

    def __init__(self, home: Path | None = None, quota: Mapping[str, int] | None = None):
        """`quota` caps the tasks per split (default: 48 train, 170 heldout); tests build less."""
        self._home = home
        self._quota = dict(quota or QUOTA)
        self._tasks: dict[str, list[Task]] | None = None
        self._corpus: Corpus | None = None
        self._edition: int | None = None

    # -- building -----------------------------------------------------------------------------
    def build(self, home: Path, seed: int = 0, edition: int | None = None) -> None:
        """Create corpus and tasks under home/localcomp; a no-op when they are built already.

        `edition` picks the generator; None keeps the edition already built there for this seed
        and quota (so runs after `akv tasks build --edition 1` stay on edition 1), else builds
        the default edition.
        """
        if edition is not None and edition not in EDITIONS:
            raise ValueError(f"unknown localcomp edition {edition!r}: expected one of "
                             f"{', '.join(map(str, EDITIONS))}")
        self._home, self._tasks, self._edition = Path(home), None, None
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        built = _read_json(root / "build.json")
        complete = (root / "corpus.sqlite").exists() and (root / "tasks.json").exists()
        if edition is None:
            kept = built.get("edition") if isinstance(built, dict) else None
            edition = kept if kept in EDITIONS and built == self._manifest(seed, kept) else DEFAULT_EDITION
        manifest = self._manifest(seed, edition)
        if built == manifest and complete:
            return
        self.close()
        atlas = Atlas(_facts(root))
        index = root / f"corpus.sqlite.{os.getpid()}.tmp"
        index.unlink(missing_ok=True)
        write_index(render_corpus(atlas, seed), index)
        corpus = Corpus(index)
        try:
            tasks = _generate(atlas, corpus, seed, self._quota, edition)
        finally:
            corpus.close()
        os.replace(index, root / "corpus.sqlite")
        _write_json(root / "tasks.json", [_task_json(t) for t in tasks])
        _write_json(root / "build.json", manifest)  # last: a build cut short is never taken as done

    def _manifest(self, seed: int, edition: int) -> dict[str, Any]:
        """Every build parameter: the edition and its design, the seed and the quotas."""
        design = EDITIONS[edition]
        extra = {} if edition == 1 else {"design": asdict(design)}
        manifest = {"edition": edition, "version": design.version, "seed": seed, "quota": self._quota, **extra}
        return json.loads(json.dumps(manifest))  # as it reads back from build.json (tuples become lists)

    @property
    def edition(self) -> int:
        """The edition of the build under the data folder (from its manifest)."""
        if self._edition is None:
            built = _read_json(self.root / "build.json")
            edition = built.get("edition") if isinstance(built, dict) else None
            if edition not in EDITIONS:
                raise ValueError("localcomp is not built yet (or was built by an older version): "
                                 "run `akv tasks build --suite localcomp`")
            self._edition = edition
        return self._edition

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
                rows = json.loads(path.read_text(encoding="utf-8"))
                tools = tools_of(self.edition)
                loaded = [_task_from_json(t, tools) for t in rows]
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
        return LocalCompEnv(self._corpus, task, self.edition)

    def scripted_agent(self, task: Task) -> ScriptedAgent:
        return ScriptedAgent(task, self.edition)

    summary_facts = staticmethod(summary_facts)  # how the replay summarizer reads this suite (summary.py)

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


def _generate(atlas: Atlas, corpus: Corpus, seed: int, quota: Mapping[str, int], edition: int) -> list[Task]:
    """Drafts in seeded order; a draft becomes a task when the scripted agent, seeing everything,
    reaches the gold answer with a trajectory of the intended length."""
    count = {s: 0 for s in SPLITS}
    tasks = []
    design = EDITIONS[edition]
    for draft in drafts(atlas, seed, edition):
        if count[draft.split] >= quota[draft.split]:
            if all(count[s] >= quota[s] for s in SPLITS):
                break
            continue
        task = make_task(draft, count[draft.split], corpus.docid_of, tools_of(edition))
        env = LocalCompEnv(corpus, task, edition)
        run = walk(task, env, ScriptedAgent(task, edition))
        tokens = trajectory_tokens(task, run.messages)
        low, high = design.trajectory_tokens
        dead_ends = read_context(run.messages, [True] * len(run.messages)).dead_ends
        # a dead end is never needed again: a document ruled out for one hop but needed by another is not one
        if env.grade(run.answer).score < 1.0 or not low <= tokens <= high or len(dead_ends) < design.min_dead_ends \
                or not dead_ends.isdisjoint(task.meta["gold_docs"]):
            continue
        meta = {**task.meta, "hard_negatives": _hard_negatives(run.messages, set(task.meta["gold_docs"])),
                "reference_tokens": tokens, "reference_steps": run.steps}
        if edition > 1:
            meta["reference_dead_ends"] = len(dead_ends)
        tasks.append(Task(task.id, task.suite, task.split, task.system, task.prompt, task.tools, meta))
        count[draft.split] += 1
    return tasks


def _hard_negatives(messages: tuple[dict[str, Any], ...], gold: set[str]) -> list[str]:
    """Documents the research met before the right one: hits ranked above a gold document in a
    search the plan made, and documents opened and ruled out."""
    out: set[str] = set()
    for m in messages:
        if m.get("role") == "tool" and (m["content"].startswith("[{") or read_search_page(m["content"])):
            page = read_search_page(m["content"])
            hits = [h["docid"] for h in (page[1] if page else json.loads(m["content"]))]
            first_gold = next((i for i, d in enumerate(hits) if d in gold), len(hits))
            out.update(hits[:first_gold])
        elif m.get("role") == "assistant":
            out.update(read_context([m], [True]).dead_ends)
    return sorted(out - gold)


def _task_json(task: Task) -> dict[str, Any]:
    return {"id": task.id, "split": task.split, "system": task.system, "prompt": task.prompt,
            "meta": dict(task.meta)}


def _task_from_json(data: dict[str, Any], tools: tuple[Mapping[str, Any], ...]) -> Task:
    return Task(id=data["id"], suite="localcomp", split=data["split"], system=data["system"],
                prompt=data["prompt"], tools=tools, meta=data["meta"])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
