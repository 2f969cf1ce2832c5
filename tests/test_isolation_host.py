"""Task commands see the host read-only, without its secrets, with a /tmp of their own.

These hold under bubblewrap; where it is missing or cannot run, they are skipped with the
reason (task commands are then refused: tests/test_isolation_fail_closed.py). The opt-out is
unset here, whatever the environment that runs the tests.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sandbox.isolation.hostview import HostView, bwrap_argv, interpreter_paths
from sandbox.isolation.sandbox import UNSAFE_ENV, Limits, Sandbox, bwrap_failure

LIMITS = Limits(cpu_s=10, wall_s=20.0, processes=16)
needs_bwrap = pytest.mark.skipif(bwrap_failure() is not None,
                                 reason=f"the host view needs bubblewrap: {bwrap_failure()}")


@pytest.fixture(autouse=True)
def confined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSAFE_ENV, raising=False)

# Prints, per path, what reading it gave: the text, the listing, or the error's name.
PROBE = """
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as error:
        seen[path] = type(error).__name__
print(json.dumps(seen))
"""


def probe(sandbox: Sandbox, *paths: str) -> dict[str, object]:
    result = sandbox.run([sys.executable, "-c", PROBE, *paths])
    assert result.returncode == 0, result.output
    return json.loads(result.output)


@pytest.fixture
def sandbox(tmp_path: Path):
    (tmp_path / "src").mkdir()
    with Sandbox.copy_of(tmp_path / "src", LIMITS) as box:
        yield box


@needs_bwrap
def test_secrets_are_unreadable_directly_and_through_links_in_the_task_copy(sandbox: Sandbox,
                                                                           host_folder: Path) -> None:
    private = host_folder / "private"
    private.mkdir(mode=0o700)
    (private / "key").write_text("the host's secret")
    (private / "key").chmod(0o600)
    for name, target in (("shadow", "/etc/shadow"), ("key", private / "key"), ("home", "/root")):
        os.symlink(target, sandbox.root / name)
    seen = probe(sandbox, "/etc/shadow", str(private / "key"), str(private), "/root", "shadow", "key", "home")
    # /etc/shadow is /dev/null on a nodev mount; the private key is the host's, unreadable without capabilities.
    assert seen["/etc/shadow"] == seen["shadow"] == "PermissionError"
    assert seen[str(private / "key")] == seen["key"] == seen[str(private)] == "PermissionError"
    # /root holds nothing but the way to the interpreter (which may live there, e.g. under pyenv).
    ways_in = {p.relative_to("/root").parts[0] for p in interpreter_paths() if Path("/root") in p.parents}
    assert set(seen["/root"]) <= ways_in and seen["home"] == seen["/root"]


@needs_bwrap
def test_the_data_folder_and_other_task_copies_are_hidden(tmp_path: Path, host_folder: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    data = host_folder / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    monkeypatch.setenv("AKV_HOME", str(data))
    (tmp_path / "src").mkdir()
    with Sandbox.copy_of(tmp_path / "src", LIMITS) as first, Sandbox.copy_of(tmp_path / "src", LIMITS) as second:
        first.write_text("notes.txt", "the first task's work")
        seen = probe(second, str(first.root / "notes.txt"), str(data), str(data / "manifest.json"))
        assert seen == {str(first.root / "notes.txt"): "FileNotFoundError", str(data): [],
                        str(data / "manifest.json"): "FileNotFoundError"}
        assert probe(first, "notes.txt") == {"notes.txt": "the first task's work"}  # its own copy stays


@needs_bwrap
def test_tmp_is_private_to_each_command_and_gone_after_it(sandbox: Sandbox) -> None:
    name = f"akv-left-behind-{os.getpid()}"
    wrote = sandbox.run([sys.executable, "-c", f"open('/tmp/{name}', 'w').write('x'); print(len(__import__('os').listdir('/tmp')))"])
    assert wrote.returncode == 0, wrote.output
    assert not Path("/tmp", name).exists()
    assert probe(sandbox, f"/tmp/{name}") == {f"/tmp/{name}": "FileNotFoundError"}


@needs_bwrap
def test_no_capabilities_and_the_same_interpreter_read_only(sandbox: Sandbox) -> None:
    code = ("import json, sys, pytest\nstatus = dict(l.split(':\\t', 1) for l in open('/proc/self/status'))\n"
            "caps = {k: int(v, 16) for k, v in status.items() if k.startswith('Cap')}\n"
            "try:\n    open(sys.prefix + '/written-by-a-task', 'w')\n    wrote = 'yes'\n"
            "except OSError as error:\n    wrote = type(error).__name__\n"
            "print(json.dumps([caps, status['NoNewPrivs'].strip(), sys.version, sys.prefix, pytest.__file__,"
            " open('/proc/self/personality').read().strip(), wrote]))")
    result = sandbox.run([sys.executable, "-c", code])
    assert result.returncode == 0, result.output
    caps, no_new_privs, version, prefix, pytest_file, personality, wrote = json.loads(result.output)
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} and not any(caps.values())
    assert no_new_privs == "1"
    assert (version, prefix, pytest_file) == (sys.version, sys.prefix, pytest.__file__)
    assert int(personality, 16) & 0x0040000  # ADDR_NO_RANDOMIZE: reproducible test ids
    assert wrote == "OSError" and not Path(sys.prefix, "written-by-a-task").exists()  # read-only


def test_the_most_specific_rule_wins_whatever_the_nesting() -> None:
    """A hidden folder inside an exposed one stays hidden; folders made inside a tmpfs are enterable."""
    view = HostView(hidden=(Path("/home/me"), Path("/home/me/venv/data")), hidden_files=(Path("/etc/shadow"),),
                    exposed=(Path("/home/me/venv"),))
    argv = bwrap_argv("bwrap", view, Path("/home/me/work/repo"), 1 << 20, user_namespace=False)
    mounts = [(argv[i], argv[i + 1]) for i in range(len(argv) - 1)
              if argv[i] in ("--tmpfs", "--dir", "--ro-bind", "--bind")]
    assert mounts == [("--ro-bind", "/"), ("--ro-bind", "/dev/null"), ("--tmpfs", "/home/me"),
                      ("--ro-bind", "/home/me/venv"), ("--tmpfs", "/home/me/venv/data"),
                      ("--dir", "/home/me/work"), ("--bind", "/home/me/work/repo")]
    assert argv[argv.index("/home/me/work") - 2:argv.index("/home/me/work")] == ["0755", "--dir"]
