"""Commands in a sandbox cannot exhaust the host, reach the network or outlive their limits.

Each hostile command runs under tight limits (a few seconds, a few processes), so a failure
of containment stays small on a shared machine. Every test runs under each mechanism this
machine offers (bubblewrap and the fallback without it, which runs only with the opt-out
`AKV_UNSAFE_NO_SANDBOX=1`, set here for it), so the fallback stays tested too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sandbox.isolation.sandbox import UNSAFE_ENV, Containment, Limits, Sandbox, _processes_of, containments

TIGHT = Limits(cpu_s=5, wall_s=5.0, memory_bytes=1 << 30, file_bytes=1 << 20, processes=16,
               output_bytes=4096)
PY = sys.executable


@pytest.fixture(params=containments(), ids=lambda mode: mode.host)
def mode(request, monkeypatch: pytest.MonkeyPatch) -> Containment:
    if request.param.host == "shared":
        monkeypatch.setenv(UNSAFE_ENV, "1")  # the host as it is: only with the opt-out
    return request.param


@pytest.fixture
def sandbox(tmp_path: Path, mode: Containment):
    (tmp_path / "src").mkdir()
    with Sandbox.copy_of(tmp_path / "src", TIGHT, mode=mode) as box:
        yield box


def python(sandbox: Sandbox, code: str, wall_s: float | None = None):
    return sandbox.run([PY, "-c", code], wall_s=wall_s)


def test_an_ordinary_command_runs_and_can_write_its_folder(sandbox: Sandbox) -> None:
    result = python(sandbox, "open('out.txt', 'w').write('ok'); print('done')")
    assert result.returncode == 0 and result.output.strip() == "done"
    assert (sandbox.root / "out.txt").read_text() == "ok"
    again = python(sandbox, "open('out.txt', 'a').write('!')")  # a later command, another uid
    assert again.returncode == 0 and (sandbox.root / "out.txt").read_text() == "ok!"


def test_a_fork_bomb_is_contained_and_the_next_command_runs(sandbox: Sandbox) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = python(sandbox, bomb, wall_s=2)
    assert result.timed_out and result.returncode is None
    assert all(not _processes_of(uid) for uid in sandbox._uids)  # nothing left alive
    assert python(sandbox, "print('after')").output.strip() == "after"


def test_a_10_gb_allocation_fails_inside_the_command(sandbox: Sandbox) -> None:
    result = python(sandbox, "b = bytearray(10 * 2**30)")
    assert result.returncode == 1 and "MemoryError" in result.output


def test_sleeping_forever_is_killed_with_its_background_children(sandbox: Sandbox) -> None:
    result = sandbox.run(["sh", "-c", "sleep 1000 & sleep 1000"], wall_s=1)
    assert result.timed_out and result.summary() == "killed: wall-clock timeout"
    assert all(not _processes_of(uid) for uid in sandbox._uids)


def test_no_network(sandbox: Sandbox) -> None:
    code = ("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
            "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)")
    result = python(sandbox, code)
    assert "refused" in result.output and "CONNECTED" not in result.output


def test_cpu_time_and_file_size_are_limited(tmp_path: Path, mode: Containment) -> None:
    (tmp_path / "src").mkdir()
    with Sandbox.copy_of(tmp_path / "src", Limits(cpu_s=1, wall_s=60, file_bytes=1 << 20), mode=mode) as sandbox:
        spin = python(sandbox, "while True: pass")  # RLIMIT_CPU ends it long before the wall
        assert not spin.timed_out and spin.signal_name in ("SIGXCPU", "SIGKILL")
        big = python(sandbox, "open('big', 'wb').write(b'x' * (8 << 20))")
        assert big.returncode != 0 and (sandbox.root / "big").stat().st_size <= 1 << 20


def test_output_is_cut_at_the_limit(sandbox: Sandbox) -> None:
    result = python(sandbox, "print('x' * 100000)")
    assert result.returncode == 0 and result.output_dropped > 90000
    assert len(result.output) < TIGHT.output_bytes + 100


def test_the_host_outside_the_folder_is_read_only(sandbox: Sandbox, host_folder: Path) -> None:
    if sandbox.mode.host != "bwrap" and sandbox.mode.processes != "own-uid":
        pytest.skip("without bubblewrap, host files are protected by the command's own uid, which needs root")
    host_file = host_folder / "host.txt"
    host_file.write_text("untouched")
    result = python(sandbox, f"open({str(host_file)!r}, 'w').write('changed')")
    refusal = "Read-only file system" if sandbox.mode.host == "bwrap" else "PermissionError"
    assert result.returncode == 1 and refusal in result.output
    assert host_file.read_text() == "untouched"
    if sandbox.mode.processes == "own-uid":
        assert python(sandbox, "import os; print(os.getuid())").output.strip() != "0"
