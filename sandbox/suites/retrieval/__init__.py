"""retrieval: deep-research suites built from a user's own documents and questions (BrowseComp-Plus style).

    akv tasks import retrieval --corpus docs.jsonl --queries queries.jsonl --name NAME

builds, under the data folder's `suites/NAME/`, localcomp's FTS5 index of the documents
(`corpus.sqlite`), the tasks (`tasks.json`) and the manifest (`suite.json`, written last). The
suite then runs like any other (`akv run --suite NAME`, `akv evolve --suite NAME`): the same
`search` / `get_document` tools and retriever as localcomp, the `llm` agent, a grader
(localcomp's normalized exact match, then an optional judge endpoint) and a scripted agent for
questions with evidence ids. See docs/sandbox.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox.suites.base import Grade, Task
from sandbox.suites.localcomp.corpus import Corpus, write_index
from sandbox.suites.localcomp.documents import Document
from sandbox.suites.localcomp.env import TOOLS, LocalCompEnv
from sandbox.suites.retrieval.agent import EvidenceAgent
from sandbox.suites.retrieval.grading import Judge, gold_of, grade
from sandbox.suites.retrieval.importer import SPLITS, SourceDocument, SourceQuery, read_documents, read_queries
from sandbox.suites.version import content_version

KIND = "retrieval"
FOLDER = "suites"  # imported suites live in the data folder under suites/NAME
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
SYSTEM = ("You are a research agent working offline over a collection of documents. Use the search tool to "
          "find documents and get_document to read them; answers may need several documents. When you are "
          "done, reply without tool calls and end with 'Answer: <answer>'.")


@dataclass(frozen=True)
class Imported:
    name: str
    root: Path
    documents: int
    tasks: dict[str, int]  # split -> tasks


def imported_root(home: Path, name: str) -> Path:
    return Path(home) / FOLDER / name


def imported_names(home: Path) -> list[str]:
    """Names of the retrieval suites imported under `home`, sorted."""
    folder = Path(home) / FOLDER
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "suite.json").is_file() and NAME.match(p.name)
                  and _manifest(p).get("kind") == KIND)


def import_suite(name: str, corpus: Path, queries: Path, home: Path, judge: Judge | None = None,
                 replace: bool = False, taken: set[str] = frozenset()) -> Imported:
    """Read, check and index the files; ValueError (an ImportFileError names file, line and field)."""
    if not NAME.match(name):
        raise ValueError(f"--name: {name!r} is not a suite name (lower-case letters, digits, '-' and '_', "
                         "64 at most, starting with a letter or digit)")
    if name in taken:
        raise ValueError(f"--name: {name!r} is the name of an installed suite; choose another")
    root = imported_root(home, name)
    if (root / "suite.json").exists() and not replace:
        raise ValueError(f"--name: a suite {name!r} is already imported at {root}; pass --replace to rebuild it")
    docs = read_documents(corpus)
    questions = read_queries(queries, {d.id for d in docs})
    staging = root.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_index([_document(d) for d in docs], staging / "corpus.sqlite")
        _write_json(staging / "tasks.json", [_task_json(q) for q in questions])
        _write_json(staging / "suite.json", {
            "kind": KIND, "name": name, "edition": 1, "judge": judge.to_json() if judge else None,
            "sources": {"corpus": _source(corpus), "queries": _source(queries)}})
        _swap_in(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    counts = {s: sum(q.split == s for q in questions) for s in SPLITS}
    return Imported(name, root, len(docs), counts)


def _document(doc: SourceDocument) -> Document:
    """A localcomp index row; the text opens with `[id] title`, as localcomp's articles do."""
    return Document(docid=doc.id, key=doc.id, kind="document", title=doc.title,
                    text=f"[{doc.id}] {doc.title}\n{doc.text}")


def _task_json(q: SourceQuery) -> dict[str, Any]:
    return {"id": q.id, "split": q.split, "prompt": q.question, "evidence_ids": list(q.evidence_ids),
            "gold": gold_of(q.answer, q.aliases)}


def _source(path: Path) -> dict[str, str]:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"file": path.name, "sha256": digest}


def _swap_in(staging: Path, root: Path) -> None:
    """Replace `root` by `staging` so that a reader sees the old suite or the new one, never a mix."""
    old = root.with_name(f".{root.name}.{os.getpid()}.old")
    if root.exists():
        os.replace(root, old)
    os.replace(staging, root)
    shutil.rmtree(old, ignore_errors=True)


class RetrievalSuite:
    """An imported suite, by name (sandbox.suites.base.Suite)."""

    def __init__(self, name: str, home: Path | None = None) -> None:
        from akv_core.home import akv_home

        self.name = name
        self.root = imported_root(home or akv_home(), name)
        self._tasks: dict[str, list[Task]] | None = None
        self._corpus: Corpus | None = None
        self._judge_backend: Any = None

    def build(self, home: Path, seed: int = 0) -> None:
        """Nothing to generate: the data is the user's. Checks that it was imported under `home`."""
        self.root = imported_root(home, self.name)
        if not (self.root / "suite.json").is_file():
            raise ValueError(f"suite {self.name!r} is not imported under {home}: run `akv tasks import retrieval "
                             f"--corpus docs.jsonl --queries queries.jsonl --name {self.name}`")

    def version(self, home: Path) -> str:
        root = imported_root(home, self.name)
        return content_version(self.name, root / "suite.json", [root / "tasks.json", root / "corpus.sqlite"])

    def tasks(self, split: str) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for {self.name}: expected one of {', '.join(SPLITS)}")
        if self._tasks is None:
            rows = json.loads(self._file("tasks.json").read_text(encoding="utf-8"))
            loaded = [Task(id=r["id"], suite=self.name, split=r["split"], system=SYSTEM, prompt=r["prompt"],
                           tools=TOOLS, meta={"gold": r["gold"], "evidence_ids": r["evidence_ids"]})
                      for r in rows]
            self._tasks = {s: [t for t in loaded if t.split == s] for s in SPLITS}
        return list(self._tasks[split])

    def open(self, task: Task) -> RetrievalEnv:
        if self._corpus is None:
            self._corpus = Corpus(self._file("corpus.sqlite"))
        return RetrievalEnv(LocalCompEnv(self._corpus, task), task, self._judge())

    def scripted_agent(self, task: Task) -> EvidenceAgent:
        if not task.meta["evidence_ids"]:
            raise ValueError(f"task {task.id!r} lists no evidence ids: the scripted agent needs them "
                             "(use --agent llm)")
        return EvidenceAgent(task)

    def close(self) -> None:
        if self._corpus is not None:
            self._corpus.close()
            self._corpus = None
        if self._judge_backend is not None:
            self._judge_backend[1].close()
            self._judge_backend = None

    def _judge(self) -> tuple[Judge, Any] | None:
        """The judge and a client for it, made on first use; None without a judge."""
        if self._judge_backend is None:
            data = _manifest(self.root).get("judge")
            if not data:
                return None
            from sandbox.backends.http import HttpBackend

            judge = Judge(data["url"], data["model"])
            self._judge_backend = (judge, HttpBackend(judge.url, judge.model))
        return self._judge_backend

    def _file(self, name: str) -> Path:
        path = self.root / name
        if not (self.root / "suite.json").is_file() or not path.is_file():
            raise ValueError(f"suite {self.name!r} is not imported (missing {path}): run `akv tasks import "
                             f"retrieval --corpus docs.jsonl --queries queries.jsonl --name {self.name}`")
        return path


class RetrievalEnv:
    """localcomp's tools over the imported index; the question's own grading."""

    def __init__(self, tools: LocalCompEnv, task: Task, judge: tuple[Judge, Any] | None) -> None:
        self._tools, self._task, self._judge = tools, task, judge

    def call_tool(self, name: str, arguments: Any) -> str:
        return self._tools.call_tool(name, arguments)

    def grade(self, answer: str | None) -> Grade:
        judge, backend = self._judge or (None, None)
        return grade(answer, self._task.meta["gold"], self._task.prompt, judge, backend)

    def close(self) -> None:
        """The index is shared by the suite's runs and closed with it."""


def _manifest(root: Path) -> dict[str, Any]:
    try:
        data = json.loads((root / "suite.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
