"""localcomp build: sizes, determinism, idempotence and split disjointness."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sandbox.suites import get_suite
from sandbox.suites.localcomp import DEFAULT_EDITION, EDITIONS, LocalComp
from sandbox.suites.localcomp.atlas import Atlas
from sandbox.suites.localcomp.corpus import render_corpus
from sandbox.suites.localcomp.facts import FACTS_VERSION, Facts
from sandbox.suites.localcomp.tasks import QUOTA, SPLITS, drafts


TEST_QUOTA = {"train": 16, "heldout": 24}  # the full build (48 / 170) takes too long for a test


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> LocalComp:
    # One build per test session: every localcomp test module names the same folder and quota,
    # and the build is a no-op when that folder already holds them.
    home = tmp_path_factory.getbasetemp() / "localcomp-home"
    built = LocalComp(quota=TEST_QUOTA)
    built.build(home, seed=0)
    yield built
    built.close()


@pytest.fixture(scope="module")
def atlas(suite: LocalComp) -> Atlas:
    path = suite.root / f"facts.v{FACTS_VERSION}.json"
    return Atlas(Facts.from_json(json.loads(path.read_text(encoding="utf-8"))))


def test_registry_returns_the_suite() -> None:
    assert get_suite("localcomp").name == "localcomp"


def test_build_fills_each_split_to_its_quota(suite: LocalComp) -> None:
    assert {s: len(suite.tasks(s)) for s in SPLITS} == TEST_QUOTA


def test_full_quotas_have_room_to_spare(atlas: Atlas) -> None:
    # The full build keeps a draft only when the scripted agent solves it at the intended length
    # (about 85% do), so each split needs well over its quota in drafts.
    assert QUOTA["train"] >= 40 and QUOTA["heldout"] >= 150
    supply = Counter(d.split for d in drafts(atlas, 0))
    for split in SPLITS:
        assert supply[split] >= 1.5 * QUOTA[split], split


def test_unknown_split_names_the_known_ones(suite: LocalComp) -> None:
    with pytest.raises(ValueError, match="train, heldout"):
        suite.tasks("test")


def test_unbuilt_suite_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="akv tasks build"):
        LocalComp(tmp_path).tasks("train")


def test_splits_share_no_question_fact_or_anchor(suite: LocalComp) -> None:
    train, heldout = suite.tasks("train"), suite.tasks("heldout")
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    for key in ("hinges", "anchors"):
        train_keys = {k for t in train for k in t.meta[key]}
        heldout_keys = {k for t in heldout for k in t.meta[key]}
        assert train_keys and heldout_keys
        assert not train_keys & heldout_keys, key


def test_tasks_are_well_formed(suite: LocalComp) -> None:
    tasks = suite.tasks("train") + suite.tasks("heldout")
    assert len({t.id for t in tasks}) == len(tasks)
    for task in tasks:
        assert task.suite == "localcomp"
        assert {tool["function"]["name"] for tool in task.tools} == {"search", "get_document"}
        assert task.meta["gold_docs"] and task.meta["evidence"]
        assert set(task.meta["gold_docs"]).isdisjoint(task.meta["hard_negatives"])
        for leg in task.meta["plan"]["legs"]:
            assert leg["label"] in task.prompt


def test_second_build_keeps_the_files(suite: LocalComp) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in suite.root.iterdir()}
    LocalComp(quota=TEST_QUOTA).build(suite.root.parent, seed=0)
    after = {p.name: p.stat().st_mtime_ns for p in suite.root.iterdir()}
    assert before == after


@pytest.mark.parametrize("edition", [1, 2])
def test_corpus_and_drafts_are_deterministic_in_the_seed(atlas: Atlas, edition: int) -> None:
    first, again, other = render_corpus(atlas, 0), render_corpus(atlas, 0), render_corpus(atlas, 1)
    assert 3000 <= len(first) == len(other)
    assert first == again
    assert {d.key: d.docid for d in first} != {d.key: d.docid for d in other}
    prompts = [tuple(leg.clue for leg in d.legs) for d in drafts(atlas, 0, edition)]
    assert prompts == [tuple(leg.clue for leg in d.legs) for d in drafts(atlas, 0, edition)]
    assert prompts != [tuple(leg.clue for leg in d.legs) for d in drafts(atlas, 1, edition)]


def test_manifest_records_every_build_parameter(suite: LocalComp) -> None:
    manifest = json.loads((suite.root / "build.json").read_text(encoding="utf-8"))
    design = EDITIONS[DEFAULT_EDITION]
    assert manifest == {"edition": DEFAULT_EDITION, "version": design.version, "seed": 0, "quota": TEST_QUOTA,
                        "design": {"version": design.version, "trajectory_tokens": list(design.trajectory_tokens),
                                   "min_dead_ends": design.min_dead_ends}}
    assert suite.edition == DEFAULT_EDITION == 2


def test_edition_1_is_reproducible_and_kept_by_builds_that_name_no_edition(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    shared = tmp_path_factory.getbasetemp() / "localcomp-e1"  # the edition-1 build other modules use
    first = LocalComp(quota=TEST_QUOTA)
    first.build(shared, seed=0, edition=1)
    before = {p.name: p.stat().st_mtime_ns for p in first.root.iterdir()}
    LocalComp(quota=TEST_QUOTA).build(shared, seed=0)  # no edition named: the built one stays
    assert {p.name: p.stat().st_mtime_ns for p in first.root.iterdir()} == before and first.edition == 1
    again = LocalComp(quota=TEST_QUOTA)
    _copy_facts(first.root, tmp_path)
    again.build(tmp_path, seed=0, edition=1)
    assert (again.root / "tasks.json").read_bytes() == (first.root / "tasks.json").read_bytes()
    manifest = json.loads((again.root / "build.json").read_text(encoding="utf-8"))
    assert manifest == {"edition": 1, "version": EDITIONS[1].version, "seed": 0, "quota": TEST_QUOTA}
    assert all(t.tools[0]["function"]["description"].endswith("JSON list of {docid, title, snippet}.")
               for t in again.tasks("train"))
    # a build from before editions (no edition in its manifest) is stale: it becomes the default edition
    (again.root / "build.json").write_text(json.dumps({"version": 6, "seed": 0, "quota": TEST_QUOTA}))
    again.build(tmp_path, seed=0)
    assert again.edition == DEFAULT_EDITION
    assert [t.id for t in again.tasks("train")] == [t.id for t in first.tasks("train")]


def _copy_facts(source: Path, home: Path) -> None:
    (home / "localcomp").mkdir(parents=True, exist_ok=True)
    name = f"facts.v{FACTS_VERSION}.json"
    (home / "localcomp" / name).write_bytes((source / name).read_bytes())


def test_unknown_edition_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown localcomp edition 3: expected one of 1, 2"):
        LocalComp(quota=TEST_QUOTA).build(tmp_path, seed=0, edition=3)


def test_edition_2_questions_open_look_alikes_that_are_never_needed_again(suite: LocalComp) -> None:
    for task in suite.tasks("train") + suite.tasks("heldout"):
        assert task.meta["reference_dead_ends"] >= EDITIONS[2].min_dead_ends
        assert len(task.meta["hard_negatives"]) >= task.meta["reference_dead_ends"]
        assert set(task.meta["hard_negatives"]).isdisjoint(task.meta["gold_docs"])


def test_documents_have_realistic_sizes(atlas: Atlas) -> None:
    docs = render_corpus(atlas, 0)
    long_kinds = [d for d in docs if d.kind in ("element", "country")]
    median = sorted(len(d.text) for d in long_kinds)[len(long_kinds) // 2]
    assert 1600 <= median <= 6000  # roughly 400 to 1500 tokens


def test_questions_meet_hard_negatives(suite: LocalComp) -> None:
    tasks = suite.tasks("train") + suite.tasks("heldout")
    assert sum(bool(t.meta["hard_negatives"]) for t in tasks) >= len(tasks) // 2


def test_articles_carry_look_alike_facts_about_neighbours(atlas: Atlas) -> None:
    chlorine = next(d for d in render_corpus(atlas, 0) if d.key == "element:17")
    own, _, neighbours = chlorine.text.partition("== Neighbours in the periodic table ==")
    assert "| Melting point | 171.65 K |" in own
    assert "Argon (Ar, atomic number 18)" in neighbours and "melts at 83.81 K" in neighbours


def test_damaged_task_file_says_how_to_rebuild(tmp_path: Path) -> None:
    (tmp_path / "localcomp").mkdir()
    (tmp_path / "localcomp" / "tasks.json").write_text("[{\"id\": ", encoding="utf-8")
    with pytest.raises(ValueError, match="is damaged .* rebuild with `akv tasks build --suite localcomp`"):
        LocalComp(tmp_path).tasks("train")


def test_edition_2_trajectories_have_dead_ends_long_range_uses_and_a_size_spread(suite: LocalComp) -> None:
    from sandbox.suites.localcomp.shape import measure_shape

    shape = measure_shape(suite, "train", limit=8)
    assert shape["tasks"] == 8 and 0.15 <= shape["dead_end_share"] <= 0.6
    assert shape["dead_end_reads"] >= 8 * EDITIONS[2].min_dead_ends
    # the final answer needs a fact read in the first leg, many steps before
    assert shape["final_answer_reach"]["min"] >= 8 and shape["steps"]["min"] >= 15
    sizes = shape["sizes"]
    assert sizes["short lookup"]["max"] < 400 <= sizes["long article"]["min"]
    assert sizes["short lookup"]["median"] < sizes["search page"]["median"] < sizes["long article"]["p90"]
