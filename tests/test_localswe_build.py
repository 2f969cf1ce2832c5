"""Build steps that need no test run: candidate order from the seed, splits, the lock file."""
from __future__ import annotations

import pytest

from sandbox.suites.localswe.bugs import Bug, candidate_bugs
from sandbox.suites.localswe.hosts import LOCK_FILE, BuildError, fetch, load_hosts
from sandbox.suites.localswe.mutate import Mutation
from sandbox.suites.localswe.tasks import split_of

from test_localswe_suite import built_home


def fake_bug(host: str, n: int) -> Bug:
    mutation = Mutation("m.py", n, "flip_operator", "a == b", "a != b")
    return Bug(f"{host}-{n:02d}", host, mutation, ("t.py::test_a",), ("t.py::test_b",), (), ("t.py",))


def test_the_lock_file_pins_every_host() -> None:
    hosts = load_hosts()
    assert len(hosts) >= 4 and LOCK_FILE.name == "hosts.json"
    for host in hosts:
        assert len(host.sha256) == 64 and host.archive.startswith(f"{host.name}-{host.version}")


def test_a_corrupt_archive_is_refused(tmp_path) -> None:
    host = load_hosts()[0]
    (tmp_path / host.archive).write_bytes(b"not the archive")
    with pytest.raises(BuildError, match="does not match the lock file"):
        fetch(host, tmp_path)


def test_splits_hold_out_one_project_and_a_third_of_the_others_bugs() -> None:
    hosts = load_hosts()[:3]
    bugs = {h.key: [fake_bug(h.key, n) for n in range(6)] for h in hosts}
    split = split_of(hosts, bugs, seed=0)
    held_projects = [h.key for h in hosts if all(split[b.id] == "heldout" for b in bugs[h.key])]
    assert len(held_projects) == 1
    for host in hosts:
        if host.key not in held_projects:
            assert sum(split[b.id] == "heldout" for b in bugs[host.key]) == 2
    assert split == split_of(hosts, bugs, seed=0)
    assert any(split_of(hosts, bugs, seed=s) != split for s in range(1, 6))


def test_candidates_are_a_function_of_the_seed(tmp_path_factory) -> None:
    home = built_home(tmp_path_factory)
    host = next(h for h in load_hosts() if h.name == "isodate")
    tree = home / "localswe" / "trees" / host.key
    first = candidate_bugs(host, tree, seed=0)
    assert first == candidate_bugs(host, tree, seed=0)
    assert first != candidate_bugs(host, tree, seed=1)
    assert len({(m.path, m.line) for m in first}) == len(first)  # one bug per line
    assert {m.kind for m in first[:5]} == {"flip_operator", "invert_condition", "off_by_one",
                                           "remove_statement", "swap_arguments"}


@pytest.mark.parametrize("args, expected", [
    (["--edition", "2"], "--edition needs --suite: editions are per suite"),
    (["--suite", "localcomp", "--edition", "9"], "unknown localcomp edition 9: expected one of 1, 2"),
])
def test_tasks_build_edition_errors_name_what_was_expected(tmp_path, args: list[str], expected: str) -> None:
    from typer.testing import CliRunner

    from akv_cli.main import app

    result = CliRunner().invoke(app, ["tasks", "build", *args], env={"AKV_HOME": str(tmp_path)})
    assert result.exit_code == 2 and expected in result.output
    assert not any(tmp_path.iterdir())  # nothing was built
