"""Paths an agent names are confined to the sandbox folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox.isolation.sandbox import UNSAFE_ENV, PathEscape, Sandbox


@pytest.fixture(autouse=True)
def anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests run no command: the opt-out lets them run where bubblewrap cannot."""
    monkeypatch.setenv(UNSAFE_ENV, "1")


@pytest.fixture
def sandbox(tmp_path: Path):
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "mod.py").write_text("x = 1\n")
    with Sandbox.copy_of(source) as box:
        yield box


def test_a_relative_path_resolves_inside(sandbox: Sandbox) -> None:
    assert sandbox.resolve("pkg/mod.py") == sandbox.root / "pkg" / "mod.py"
    assert sandbox.resolve("./pkg/../pkg/mod.py".replace("/../pkg", "")) == sandbox.root / "pkg" / "mod.py"


@pytest.mark.parametrize("path", ["../outside.txt", "pkg/../../outside.txt", "/etc/passwd", "", "a\x00b"])
def test_escaping_paths_are_refused(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(PathEscape):
        sandbox.resolve(path)


def test_a_symlink_out_of_the_folder_is_refused(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "secret.txt"
    target.write_text("host file")
    os.symlink(target, sandbox.root / "link.txt")
    os.symlink(tmp_path, sandbox.root / "linkdir")
    for path in ("link.txt", "linkdir/secret.txt"):
        with pytest.raises(PathEscape):
            sandbox.resolve(path)
    with pytest.raises(PathEscape):
        sandbox.write_text("link.txt", "overwritten")
    assert target.read_text() == "host file"


def test_write_text_stays_inside_and_close_removes_the_folder(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    box = Sandbox.copy_of(tmp_path / "src")
    box.write_text("new/file.txt", "hello")
    assert (box.root / "new" / "file.txt").read_text() == "hello"
    box.close()
    assert not box.root.exists()
