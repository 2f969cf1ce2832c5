"""localcomp tools (search, get_document), their errors, and answer grading."""
from __future__ import annotations

import json

import pytest

from sandbox.suites.base import ToolError
from sandbox.suites.localcomp import LocalComp
from sandbox.suites.localcomp.context import read_search_page
from sandbox.suites.localcomp.grading import first_number, grade_answer, normalize
from sandbox.suites.localcomp.reading import read_articles
from test_sandbox_support import small_localcomp



@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> LocalComp:
    built = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-home")
    yield built
    built.close()


@pytest.fixture()
def env(suite: LocalComp):
    task = suite.tasks("train")[0]
    env = suite.open(task)
    yield env
    env.close()


def search(env, query: str) -> list[dict[str, str]]:
    page = env.call_tool("search", {"query": query})
    parsed = read_search_page(page)
    assert parsed is not None and parsed[0] == query, page
    return list(parsed[1])


def test_search_returns_a_result_page_that_names_its_query(env) -> None:
    page = env.call_tool("search", {"query": "CAS number 7782-50-5"})
    assert page.startswith('Search results for "CAS number 7782-50-5": ')
    hits = search(env, "CAS number 7782-50-5")
    assert 1 <= len(hits) <= 5
    assert set(hits[0]) == {"docid", "title", "snippet"} and all(h["snippet"] for h in hits)
    assert hits[0]["title"] == "Chlorine"  # the CAS number is searched as one phrase
    assert not read_articles(page)  # a hit line is never taken for an article's header


def test_edition_1_search_returns_a_json_list(tmp_path_factory: pytest.TempPathFactory) -> None:
    first = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-e1", edition=1)
    env = first.open(first.tasks("train")[0])
    hits = json.loads(env.call_tool("search", {"query": "CAS number 7782-50-5"}))
    assert set(hits[0]) == {"docid", "title", "snippet"} and hits[0]["title"] == "Chlorine"
    first.close()


def test_search_ranks_the_titled_article_first(env) -> None:
    assert search(env, "Italy country")[0]["title"] == "Italy"


def test_search_without_words_finds_nothing(env) -> None:
    assert search(env, "?? --") == []
    assert env.call_tool("search", {"query": "?? --"}) == 'Search results for "?? --": 0 hits'


def test_get_document_returns_the_article(env) -> None:
    docid = search(env, "Chlorine")[0]["docid"]
    text = env.call_tool("get_document", {"docid": docid})
    assert text.startswith(f"[{docid}] Chlorine\nChemical element")
    assert "| Discovery year | 1774 |" in text


@pytest.mark.parametrize("name, arguments, message", [
    ("get_document", {"docid": "lc-99999"}, "no document with docid 'lc-99999'"),
    ("get_document", {}, "argument 'docid' must be a non-empty string"),
    ("search", {"query": 42}, "argument 'query' must be a non-empty string"),
    ("search", {"query": "   "}, "argument 'query' must be a non-empty string"),
    ("search", ["Chlorine"], "arguments must be a JSON object"),
    ("browse", {"url": "x"}, "unknown tool 'browse'"),
])
def test_agent_mistakes_are_tool_errors(env, name, arguments, message) -> None:
    with pytest.raises(ToolError, match=message):
        env.call_tool(name, arguments)


def test_normalize_ignores_case_accents_punctuation_and_articles() -> None:
    assert normalize("The  Åland Islands!") == "aland islands"
    assert normalize("Korea, Republic of") == normalize("korea republic of")
    assert normalize("An Element") == "element"


def test_first_number_reads_commas_signs_and_units() -> None:
    assert first_number("about 1,204 years") == 1204.0
    assert first_number("-3.5 K") == -3.5
    assert first_number("no idea") is None


NUMBER = {"type": "number", "answer": "225", "tolerance": 0}
MELT = {"type": "number", "answer": "171.65", "tolerance": 0.5}
NAME = {"type": "name", "answer": "Russian Federation", "aliases": ["Russian Federation", "RUS", "Russia"]}


@pytest.mark.parametrize("answer, gold, score", [
    ("225", NUMBER, 1.0), ("Answer: 225 years", NUMBER, 1.0), ("226", NUMBER, 0.0), ("two", NUMBER, 0.0),
    ("171.9 K", MELT, 1.0), ("172.2", MELT, 0.0),
    ("the Russian Federation.", NAME, 1.0), ("rus", NAME, 1.0), ("Russia", NAME, 1.0), ("Belarus", NAME, 0.0),
    ("", NAME, 0.0), (None, NUMBER, 0.0),
    ("A = 1999; B = 1774.\nAnswer: 225", NUMBER, 1.0), ("Checked 3 countries.\nANSWER: Russia", NAME, 1.0),
])
def test_grading(answer, gold, score) -> None:
    assert grade_answer(answer, gold).score == score


def test_env_grades_against_the_task_gold(suite: LocalComp) -> None:
    task = suite.tasks("train")[0]
    env = suite.open(task)
    gold = task.meta["gold"]["answer"]
    assert env.grade(gold).score == 1.0
    assert env.grade("Answer: nothing like it").score == 0.0


def _top_document(env, query: str) -> str:
    docid = search(env, query)[0]["docid"]
    return env.call_tool("get_document", {"docid": docid})


def test_articles_read_back_from_text(env) -> None:
    chlorine, euro = _top_document(env, "Chlorine"), _top_document(env, "Euro EUR")
    first, second = read_articles(f"[result of get_document]\n{chlorine}\n\n{euro}")
    assert (first.title, first.kind) == ("Chlorine", "Chemical element")
    assert first.fields["Discovery year"] == "1774"
    assert (second.title, second.kind, second.fields["ISO 4217 code"]) == ("Euro", "Currency", "EUR")
    france = {"Country": "France", "Adopted": "1999", "Until": "in use"}
    assert france in second.tables["Adoption as legal tender"]
