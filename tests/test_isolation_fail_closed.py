"""Task commands run under bubblewrap or not at all, unless the user opts out explicitly.

Without `bwrap` on PATH, or with one that cannot start (user namespaces off), a sandbox refuses
to run anything and says what is missing, how to fix it and how to opt out; a task run then
ends as an error with that reason. With `AKV_UNSAFE_NO_SANDBOX=1` commands run on the host as
before, with one warning per process. The PATH tests put a folder of their own on PATH (the
tools the probes need, and no `bwrap`, or a fake one) and forget the per-process probe around
each test.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sandbox.backends.replay import ReplayBackend
from sandbox.isolation import sandbox as isolation
from sandbox.isolation.hostview import interpreter_paths
from sandbox.isolation.sandbox import UNSAFE_ENV, Limits, Sandbox, SandboxUnavailable, bwrap_failure, containments
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.suites.base import Task

LIMITS = Limits(cpu_s=10, wall_s=30.0, processes=16)
NAMESPACE_ERROR = ("bwrap: No permissions to create new namespace, likely because the kernel does not allow "
                   "non-privileged user namespaces.")
FAKE_BWRAP = f"#!/bin/sh\necho called >> \"$(dirname \"$0\")/calls\"\necho '{NAMESPACE_ERROR}' >&2\nexit 1\n"
PRINT_OK = [sys.executable, "-c", "print('ran')"]


def _forget_probes() -> None:
    isolation._probe_bwrap.cache_clear()
    isolation._WARNED.clear()


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH is a folder with the tools the probes need and no `bwrap`; the opt-out unset; fresh probes."""
    isolation._mechanisms()  # what the kernel allows does not depend on PATH: probed with the real one
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("true", "setpriv"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), folder / tool)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))  # where task copies would land
    (tmp_path / "temp").mkdir()
    _forget_probes()
    yield folder
    _forget_probes()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "module.py").write_text("x = 1\n")
    return folder


def test_without_bubblewrap_a_task_command_is_refused_naming_it_and_the_opt_out(tools: Path, source: Path,
                                                                                 tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable) as refused:
        Sandbox.copy_of(source, LIMITS)
    message = str(refused.value)
    assert message.startswith("task commands cannot run: bubblewrap is not installed (no `bwrap` on PATH)")
    assert "`apt-get install bubblewrap`" in message
    assert f"set {UNSAFE_ENV}=1 (or pass --unsafe-no-sandbox)" in message
    assert isinstance(refused.value, ValueError)  # a build stops with it as one line
    assert not list((tmp_path / "temp").iterdir())  # refused before anything was copied
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        isolation.containment()
    assert containments()[-1].host == "shared" and "bubblewrap is not installed" in containments()[-1].note


def test_the_host_as_it_is_is_refused_even_when_asked_for_by_name(tools: Path, source: Path) -> None:
    with pytest.raises(SandboxUnavailable, match=f"unless {UNSAFE_ENV}=1 is set"):
        Sandbox.copy_of(source, LIMITS, mode=containments()[-1])


def test_a_refused_task_run_ends_as_an_error_with_the_reason(tools: Path, source: Path) -> None:
    class Suite:  # opens its task the way localswe does: a sandboxed copy of a tree
        name = "sandboxed"

        def open(self, task: Task) -> object:
            return Sandbox.copy_of(source, LIMITS)

    class Idle:
        name = "idle"

        def act(self, view: object) -> None:
            raise AssertionError("the agent must not act: the task never opened")

    task = Task(id="t1", suite="sandboxed", split="train", system="You repair code.", prompt="Fix it.", tools=())
    result, _ = run_task(task, Suite(), resolve_policy("full"), Idle(), ReplayBackend())
    assert result.status == "error" and result.score == 0.0
    assert result.reason.startswith("SandboxUnavailable: task commands cannot run: bubblewrap is not installed")
    assert UNSAFE_ENV in result.reason


def test_the_opt_out_runs_commands_on_the_host_with_one_warning(tools: Path, source: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(UNSAFE_ENV, "1")
    for _ in range(2):
        with Sandbox.copy_of(source, LIMITS) as box:
            assert box.mode.host == "shared"
            for _ in range(2):
                result = box.run(PRINT_OK)
                assert result.returncode == 0 and result.output.strip() == "ran"
    warnings = [r.getMessage() for r in caplog.records if r.name == "sandbox.isolation.sandbox"]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"sandbox: task commands are not isolated from the host: {UNSAFE_ENV}=1 "
                                  "turns the sandbox off; they ")
    assert "read every file" in warnings[0] or "read your files" in warnings[0]


def test_an_opt_out_that_is_not_1_or_0_is_an_error(tools: Path, source: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNSAFE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{UNSAFE_ENV}='yes': expected 1"):
        Sandbox.copy_of(source, LIMITS)
    monkeypatch.setenv(UNSAFE_ENV, "0")
    with pytest.raises(SandboxUnavailable):
        Sandbox.copy_of(source, LIMITS)


def test_a_bubblewrap_that_cannot_start_is_named_with_its_own_words(tools: Path, source: Path) -> None:
    (tools / "bwrap").write_text(FAKE_BWRAP)
    (tools / "bwrap").chmod(0o755)
    for _ in range(2):
        with pytest.raises(SandboxUnavailable) as refused:
            Sandbox.copy_of(source, LIMITS)
        message = str(refused.value)
        assert f"bubblewrap ({tools / 'bwrap'}) cannot start here: a trivial run exited with status 1" in message
        assert NAMESPACE_ERROR in message
        assert "kernel.unprivileged_userns_clone=1" in message and "apparmor" in message.lower()
        assert f"set {UNSAFE_ENV}=1" in message
    assert (tools / "calls").read_text().splitlines() == ["called"]  # probed once per process
    assert bwrap_failure().startswith(f"bubblewrap ({tools / 'bwrap'}) cannot start here")


def test_a_fresh_process_refuses_without_the_opt_out_and_warns_once_with_it(tools: Path, source: Path) -> None:
    """In a fresh interpreter: refused without the opt-out (no warning); with it, one line on stderr."""
    code = ("import sys\nfrom pathlib import Path\nfrom sandbox.isolation.sandbox import Sandbox, SandboxUnavailable\n"
            "for _ in range(2):\n"
            "    try:\n        box = Sandbox.copy_of(Path(sys.argv[1]))\n"
            "    except SandboxUnavailable as refused:\n        print('refused:', refused)\n        continue\n"
            "    print(box.run([sys.executable, '-c', 'print(1)']).output.strip())\n    box.close()\n")
    outputs = []
    for opt_out in ("0", "1"):
        env = {**os.environ, UNSAFE_ENV: opt_out}
        outputs.append(subprocess.run([sys.executable, "-c", code, str(source)], env=env, capture_output=True,
                                      text=True, timeout=120, cwd=Path(__file__).parent.parent))
    refused, unsafe = outputs
    assert refused.returncode == 0 and unsafe.returncode == 0, refused.stderr + unsafe.stderr
    assert [line.split(":")[0] for line in refused.stdout.splitlines()] == ["refused", "refused"]
    assert "sandbox:" not in refused.stderr
    assert unsafe.stdout.splitlines() == ["1", "1"]
    assert unsafe.stderr.count("sandbox: task commands are not isolated from the host") == 1, unsafe.stderr


# Prints what reading each path gave: a digest of the file, the folder's listing, or the error's name.
READ = """
import hashlib, json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        seen[path] = (sorted(os.listdir(path)) if os.path.isdir(path)
                      else hashlib.sha256(open(path, 'rb').read()).hexdigest())
    except OSError as error:
        seen[path] = type(error).__name__
print(json.dumps(seen))
"""


@pytest.fixture
def canary() -> Path:
    """A file only root may read, in root's home: what a task command must not see."""
    if os.geteuid() != 0:
        pytest.skip("reading /etc/shadow and /root needs root: the host's secrets are the user's files otherwise")
    if bwrap_failure():
        pytest.skip(f"the host view needs bubblewrap: {bwrap_failure()}")
    if not Path("/root").is_dir() or not Path("/etc/shadow").is_file():
        pytest.skip("needs /root and /etc/shadow")
    handle, name = tempfile.mkstemp(prefix="akv-canary-", dir="/root")
    os.write(handle, b"root's secret")
    os.close(handle)
    yield Path(name)
    os.unlink(name)


def read_in_sandbox(source: Path, *paths: str) -> dict[str, object]:
    with Sandbox.copy_of(source, LIMITS) as box:
        result = box.run([sys.executable, "-c", READ, *paths])
    assert result.returncode == 0, result.output
    return json.loads(result.output)


def test_with_bubblewrap_host_secrets_stay_hidden_and_only_the_opt_out_shows_them(
        canary: Path, source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    paths = ("/etc/shadow", "/root", str(canary))
    confined = read_in_sandbox(source, *paths)
    assert confined["/etc/shadow"] == "PermissionError"  # /dev/null on a nodev mount
    assert confined[str(canary)] == "FileNotFoundError"  # /root is an empty tmpfs...
    ways_in = {p.relative_to("/root").parts[0] for p in interpreter_paths() if Path("/root") in p.parents}
    assert set(confined["/root"]) <= ways_in  # ...but for the way to the interpreter
    monkeypatch.setenv(UNSAFE_ENV, "1")
    exposed = read_in_sandbox(source, *paths)
    assert exposed["/etc/shadow"] == hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest()
    assert exposed[str(canary)] == hashlib.sha256(b"root's secret").hexdigest()
    assert canary.name in exposed["/root"]


def test_the_flags_helper_sets_the_opt_out_for_child_processes(tools: Path, source: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UNSAFE_ENV, "0")  # restored afterwards, whatever the helper writes
    isolation.set_unsafe_no_sandbox()
    with Sandbox.copy_of(source, LIMITS) as box:
        assert box.run(PRINT_OK).output.strip() == "ran"
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{UNSAFE_ENV!r}])"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "1"
