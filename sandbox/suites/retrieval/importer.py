"""Reading a user's corpus and questions (JSON Lines), every problem named by file, line and field.

docs.jsonl:     {"id": "d1", "title": "...", "text": "..."}                          one document a line
queries.jsonl:  {"id": "q1", "question": "...", "answer": "...", "evidence_ids": ["d1", "d7"],
                 "split": "train"}      (optional: "aliases": ["..."], other answers that count)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

SPLITS = ("train", "heldout")
DOC_FIELDS = ("id", "title", "text")
QUERY_FIELDS = ("id", "question", "answer", "evidence_ids", "split")
MAX_LINE_BYTES = 16 << 20  # one document of up to 16 MiB


class ImportFileError(ValueError):
    """A problem in an import file; str() is `FILE:LINE: field 'NAME': what was expected`."""


@dataclass(frozen=True)
class SourceDocument:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class SourceQuery:
    id: str
    question: str
    answer: str
    aliases: tuple[str, ...]
    evidence_ids: tuple[str, ...]
    split: str


def read_documents(path: Path) -> list[SourceDocument]:
    """The corpus, in file order; ImportFileError at the first missing field, wrong type or duplicate id."""
    docs, first_line = [], {}
    for line, row in _rows(path):
        values = {f: _string(path, line, row, f) for f in DOC_FIELDS}
        _unique(path, line, values["id"], first_line)
        docs.append(SourceDocument(**values))
    if not docs:
        raise ImportFileError(f"{path}: no documents (expected one JSON object per line with {', '.join(DOC_FIELDS)})")
    return docs


def read_queries(path: Path, doc_ids: set[str]) -> list[SourceQuery]:
    """The questions; evidence ids must name documents of the corpus."""
    queries, first_line = [], {}
    for line, row in _rows(path):
        for name in QUERY_FIELDS:
            if name not in row:
                raise _error(path, line, name, f"missing (expected {', '.join(QUERY_FIELDS)})")
        query_id = _string(path, line, row, "id")
        _unique(path, line, query_id, first_line)
        split = _string(path, line, row, "split")
        if split not in SPLITS:
            raise _error(path, line, "split", f"expected train or heldout, got {split!r}")
        evidence = _strings(path, line, row, "evidence_ids")
        unknown = next((d for d in evidence if d not in doc_ids), None)
        if unknown is not None:
            raise _error(path, line, "evidence_ids", f"no document with id {unknown!r} in the corpus")
        queries.append(SourceQuery(query_id, _string(path, line, row, "question"), _answer(path, line, row),
                                   _strings(path, line, row, "aliases") if "aliases" in row else (),
                                   evidence, split))
    if not queries:
        raise ImportFileError(f"{path}: no questions (expected one JSON object per line with "
                              f"{', '.join(QUERY_FIELDS)})")
    return queries


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line."""
    try:
        handle = path.open("rb")
    except OSError as err:
        raise ImportFileError(f"{path}: cannot read: {err.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise ImportFileError(f"{path}:{number}: the line is over {MAX_LINE_BYTES >> 20} MiB")
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError) as err:
                raise ImportFileError(f"{path}:{number}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ImportFileError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


def _string(path: Path, line: int, row: dict[str, Any], name: str) -> str:
    if name not in row:
        raise _error(path, line, name, "missing")
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise _error(path, line, name, f"expected a non-empty string, got {json.dumps(value)[:60]}")
    return value


def _answer(path: Path, line: int, row: dict[str, Any]) -> str:
    """The reference answer: a string, or a number written as one."""
    value = row["answer"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _string(path, line, row, "answer")


def _strings(path: Path, line: int, row: dict[str, Any], name: str) -> tuple[str, ...]:
    value = row[name]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _error(path, line, name, "expected a list of non-empty strings")
    return tuple(value)


def _unique(path: Path, line: int, value: str, first_line: dict[str, int]) -> None:
    if value in first_line:
        raise _error(path, line, "id", f"duplicate {value!r} (first on line {first_line[value]})")
    first_line[value] = line


def _error(path: Path, line: int, name: str, what: str) -> ImportFileError:
    return ImportFileError(f"{path}:{line}: field {name!r}: {what}")
