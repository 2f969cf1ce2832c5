"""Injecting bugs into a host and keeping only those its own tests catch.

A candidate bug (one mutation from `mutate.bugs_in`) is kept iff, with the bug in place,
the host's relevant test modules still collect and at least one test that passed before now
fails. Its FAIL_TO_PASS tests are those; PASS_TO_PASS are the tests of the same modules
that pass before and after. "Relevant" modules are the test files that mention the mutated
module or a name it defines (so validation runs a fraction of the suite); a module no test
file mentions falls back to the whole suite.

Validation runs tests, so it is the slow part of a build: verdicts are cached per host, seed
and candidate in the data folder and reused by later builds of any size.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from sandbox.isolation.sandbox import Limits, Sandbox
from sandbox.suites.localswe.hosts import BuildError, Host, source_files
from sandbox.suites.localswe.mutate import Mutation, bugs_in
from sandbox.suites.localswe.testrun import run_pytest

# CPU time, not wall time, ends a runaway candidate: on a loaded machine a wall limit would
# reject a slow but good bug in one build and keep it in the next.
VALIDATION_LIMITS = Limits(cpu_s=120, wall_s=900, output_bytes=4 << 20)  # the -rA summary is at the end
# Bumped whenever how a candidate is judged changes (the test runs' setup included): cached
# verdicts of another version are not reused. 2: each run's own pytest temporary folder.
VALIDATION_VERSION = 2


@dataclass(frozen=True)
class Bug:
    id: str
    host: str  # Host.key
    mutation: Mutation
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    messages: tuple[tuple[str, str], ...]  # (FAIL_TO_PASS id, pytest's one-line message)
    test_files: tuple[str, ...]  # the test modules the bug was validated on

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Bug":
        return cls(data["id"], data["host"], Mutation(**data["mutation"]), tuple(data["fail_to_pass"]),
                   tuple(data["pass_to_pass"]), tuple(tuple(m) for m in data["messages"]),
                   tuple(data["test_files"]))


def validated_bugs(host: Host, tree: Path, cache: Path, seed: int, count: int, max_tries: int) -> list[Bug]:
    """The first `count` bugs among the first `max_tries` candidates of `host` (fewer if they run out).

    Verdicts are cached per candidate, in candidate order, so builds of any size for a seed
    share the work and a rebuild validates nothing it has validated before.
    """
    candidates = candidate_bugs(host, tree, seed)[:max_tries]
    path = cache / f"{host.key}-seed{seed}-v{VALIDATION_VERSION}.json"
    verdicts = _cached_verdicts(path, candidates)
    bugs: list[Bug] = []
    with _Validator(host, tree) as validator:
        for index, mutation in enumerate(candidates):
            if len(bugs) == count:
                break
            if index == len(verdicts):
                verdicts.append(validator.check(mutation))
            if verdicts[index] is not None:
                bugs.append(verdicts[index])
    cache.mkdir(parents=True, exist_ok=True)
    entries = [{"mutation": asdict(m), "bug": v.to_json() if v else None} for m, v in zip(candidates, verdicts)]
    path.write_text(json.dumps(entries, indent=1))
    return bugs


def _cached_verdicts(path: Path, candidates: list[Mutation]) -> list[Bug | None]:
    """The cached verdicts that still belong to these candidates, in order."""
    if not path.exists():
        return []
    verdicts: list[Bug | None] = []
    for entry, mutation in zip(json.loads(path.read_text()), candidates):
        if Mutation(**entry["mutation"]) != mutation:
            break
        verdicts.append(Bug.from_json(entry["bug"]) if entry["bug"] else None)
    return verdicts


class _Validator:
    """A sandboxed copy of the tree and the baseline run, made on the first candidate that needs them."""

    def __init__(self, host: Host, tree: Path) -> None:
        self.host, self.tree = host, tree
        self.sandbox: Sandbox | None = None

    def __enter__(self) -> "_Validator":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def check(self, mutation: Mutation) -> Bug | None:
        if self.sandbox is None:
            self.sandbox = Sandbox.copy_of(self.tree, VALIDATION_LIMITS)
            baseline = run_pytest(self.sandbox, self.host, list(self.host.tests))
            if not baseline.usable or not baseline.passed():
                raise BuildError(f"{self.host.key}: its own test suite does not pass ({baseline.result.summary()})")
            self.modules, self.passed_before = _test_modules(self.host, self.tree), baseline.passed()
        return _validate(self.sandbox, self.host, mutation, self.modules, self.passed_before)


def validate(host: Host, tree: Path, mutation: Mutation) -> Bug | None:
    """One mutation checked on its own (the bug it makes, or None if no test catches it)."""
    with Sandbox.copy_of(tree, VALIDATION_LIMITS) as sandbox:
        modules = _test_modules(host, tree)
        baseline = run_pytest(sandbox, host, _relevant((tree / mutation.path).read_text(), mutation, modules))
        return _validate(sandbox, host, mutation, modules, baseline.passed())


def candidate_bugs(host: Host, tree: Path, seed: int) -> list[Mutation]:
    """All bugs of the host, shuffled from the seed and interleaved by kind, one per line."""
    by_kind: dict[str, list[Mutation]] = defaultdict(list)
    for rel in source_files(host, tree):
        for mutation in bugs_in((tree / rel).read_text(), rel):
            by_kind[mutation.kind].append(mutation)
    rng = random.Random(f"{seed}:{host.key}")
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
    order, seen_lines = [], set()
    queues = [by_kind[k] for k in sorted(by_kind)]
    while any(queues):
        for queue in queues:
            if queue:
                mutation = queue.pop()
                if (mutation.path, mutation.line) not in seen_lines:
                    seen_lines.add((mutation.path, mutation.line))
                    order.append(mutation)
    return order


def _validate(sandbox: Sandbox, host: Host, mutation: Mutation, modules: dict[str, str],
              passed_before: set[str]) -> Bug | None:
    original = (sandbox.root / mutation.path).read_text()
    buggy = mutation.apply(original)
    try:
        compile(buggy, mutation.path, "exec")
    except SyntaxError:
        return None
    selected = _relevant(buggy, mutation, modules)
    sandbox.write_text(mutation.path, buggy)
    try:
        run = run_pytest(sandbox, host, selected)
    finally:
        sandbox.write_text(mutation.path, original)
    if not run.usable:
        return None
    in_scope = {t for t in passed_before if t.split("::")[0] in selected}
    fail_to_pass = sorted(in_scope & run.failed())
    if not fail_to_pass:
        return None
    pass_to_pass = sorted(in_scope & run.passed())
    messages = tuple((t, run.messages.get(t, "")) for t in fail_to_pass)
    digest = hashlib.sha256(f"{mutation.path}:{mutation.line}:{mutation.after}".encode()).hexdigest()
    bug_id = f"{host.name}-{digest[:8]}"
    return Bug(bug_id, host.key, mutation, tuple(fail_to_pass), tuple(pass_to_pass), messages,
               tuple(selected))


def _test_modules(host: Host, tree: Path) -> dict[str, str]:
    """Test module path -> its text."""
    return {p.relative_to(tree).as_posix(): p.read_text(errors="replace")
            for folder in host.tests for p in sorted((tree / folder).rglob("test_*.py"))}


def _relevant(source: str, mutation: Mutation, modules: dict[str, str]) -> list[str]:
    """Test modules naming the function around the bug, else the module or a name it defines."""
    tree = ast.parse(source)
    for names in (_enclosing_names(tree, mutation.line), {Path(mutation.path).stem} | _defined_names(tree)):
        names -= {"__init__", "main"}
        if names:
            pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
            chosen = [m for m, text in modules.items() if pattern.search(text)]
            if chosen:
                return chosen
    return sorted(modules)


def _enclosing_names(tree: ast.AST, line: int) -> set[str]:
    """Names of the functions and classes whose body holds `line`."""
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.lineno <= line <= node.end_lineno and not node.name.startswith("__")}


def _defined_names(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            if not n.name.startswith("__")}
