"""Running untrusted commands inside a task folder without risk to the host.

A `Sandbox` owns one fresh folder. Every command it runs gets:

- resource limits: CPU time, address space, file size, no core dumps (setrlimit);
- a process-count limit. RLIMIT_NPROC counts processes per *user* and is not enforced for
  root, so when we run as root each command gets its own unused unprivileged uid: the
  command runs as that uid, the limit then holds, the uid owns nothing else on the host
  (it can write only the sandbox folder, through the sandbox's group, and world-writable
  places), and every process it leaves behind can be found and killed by uid, even ones
  that left the process group.
  The interpreter may live in a folder only root can enter, so the uid keeps one
  capability, CAP_DAC_READ_SEARCH (read and search anywhere, write nothing), and
  no_new_privs stops setuid programs from giving root back;
- no network: a fresh network namespace (only a downed loopback) when the kernel lets
  us create one; otherwise a `sitecustomize` that refuses Python-level socket connections
  (weaker: it does not stop a subprocess written in C);
- a wall timeout after which every process of the command is killed (not root: its
  process group);
- bounded output: the first `output_bytes` of stdout+stderr are kept, the rest counted;
- no address-space randomization (personality ADDR_NO_RANDOMIZE): Python 3.11 hashes
  None by its address, so with ASLR a test suite parametrized from a set of tuples gets
  different test ids on every run. Reproducible runs matter more to us than ASLR inside
  a sandbox that already has no network and owns nothing.

Paths given by an agent are confined with `Sandbox.resolve`: symlinks resolved, no `..`,
no absolute path outside the folder. `containment()` says what this machine enforces.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

_CLONE_NEWNET = 0x40000000
_ADDR_NO_RANDOMIZE = 0x0040000
_UID_RANGE = (300_000, 900_000)  # far above any real account; one uid per command, one gid per sandbox
_NO_NET_SITE = '''\
"""Installed by the sandbox when no network namespace is available: no outbound sockets."""
import socket as _socket

def _refuse(*args, **kwargs):
    raise OSError("network access is disabled in this sandbox")

_socket.socket.connect = _refuse
_socket.socket.connect_ex = _refuse
_socket.create_connection = _refuse
'''


class PathEscape(ValueError):
    """A path that would leave the sandbox folder."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 60
    wall_s: float = 120.0
    memory_bytes: int = 2 << 30
    file_bytes: int = 64 << 20
    processes: int = 64
    output_bytes: int = 256 << 10


@dataclass(frozen=True)
class Containment:
    """What this machine enforces; `processes` and `network` name the mechanism."""

    processes: str  # "own-uid" (root) or "user-rlimit" (non-root: counts all our processes)
    network: str  # "netns" or "python-only"

    def describe(self) -> str:
        return f"processes: {self.processes}, network: {self.network}"


@dataclass(frozen=True)
class CommandResult:
    returncode: int | None  # None when killed by the wall timeout
    output: str  # stdout and stderr interleaved, cut at Limits.output_bytes
    timed_out: bool
    output_dropped: int  # bytes of output beyond the limit

    @property
    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        return signal.Signals(-self.returncode).name

    def summary(self) -> str:
        """One line on how the command ended, for tool output and logs."""
        if self.timed_out:
            return "killed: wall-clock timeout"
        if self.signal_name:
            return f"killed by {self.signal_name}"
        return f"exit status {self.returncode}"


@functools.lru_cache(maxsize=1)
def containment() -> Containment:
    """Probe once what the machine allows (a throw-away network namespace, root)."""
    processes = "own-uid" if _works(lambda: _become(_free_uid(), _free_uid())) else "user-rlimit"
    network = "netns" if _works(_enter_netns) else "python-only"
    return Containment(processes=processes, network=network)


def _works(confine) -> bool:
    """Whether `confine` succeeds in a child (a failed preexec step raises in the parent)."""
    if _libc() is None:
        return False
    try:
        return subprocess.run(["true"], preexec_fn=confine, capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


_PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 8, 38, 47, 2
_CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _become(uid: int, gid: int) -> None:
    """Switch to `uid`, keeping only CAP_DAC_READ_SEARCH (ambient, so it survives exec)."""
    libc = _libc()
    _check(libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    bit = 1 << _CAP_DAC_READ_SEARCH
    data = (_CapData * 2)(_CapData(bit, bit, bit), _CapData(0, 0, 0))
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0), "ambient cap")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


def _enter_netns() -> None:
    if _libc().unshare(_CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


class Sandbox:
    """One task folder and the commands run in it. Use as a context manager or call close().

    Each command runs as a fresh uid (so zombies a killed fork bomb leaves for init to reap
    never count against the next command); all of them share the sandbox's group, which
    owns the folder with group write access.
    """

    def __init__(self, root: Path, limits: Limits = Limits()):
        self.root = root.resolve()
        self.limits = limits
        self.mode = containment()
        self.gid = _free_uid() if self.mode.processes == "own-uid" else None
        self._uids: list[int] = []
        self._site = self._install_site() if self.mode.network != "netns" else None
        self._hand_over(self.root)

    @classmethod
    def copy_of(cls, source: Path, limits: Limits = Limits(), prefix: str = "akv-task-") -> "Sandbox":
        """A sandbox whose folder is a fresh copy of `source` (symlinks copied as links)."""
        parent = Path(tempfile.mkdtemp(prefix=prefix))
        parent.chmod(0o755)  # the command uids must reach the folder
        root = parent / "repo"
        shutil.copytree(source, root, symlinks=True)
        return cls(root, limits)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill anything left running and delete the folder."""
        for uid in self._uids:
            _kill_uid(uid)
        owned_parent = self.root.parent.name.startswith("akv-")
        shutil.rmtree(self.root.parent if owned_parent else self.root, ignore_errors=True)
        if self._site:
            shutil.rmtree(self._site, ignore_errors=True)

    # -- paths -------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """The real path of `path` inside the folder; PathEscape when it would leave it."""
        if not isinstance(path, str) or not path.strip():
            raise PathEscape("expected a non-empty relative path")
        if "\x00" in path:
            raise PathEscape(f"invalid path {path!r}")
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise PathEscape(f"path {path!r} must be relative to the repository, without '..'")
        real = (self.root / path).resolve()
        if real != self.root and self.root not in real.parents:
            raise PathEscape(f"path {path!r} leaves the repository")
        return real

    def write_text(self, path: str, text: str) -> Path:
        """Write a file inside the folder, writable by later commands."""
        real = self.resolve(path)
        real.parent.mkdir(parents=True, exist_ok=True)
        real.write_text(text)
        self._hand_over(real)
        return real

    def replace_folder(self, path: str, source: Path) -> None:
        """Make folder `path` a fresh copy of `source` (e.g. restore the original tests)."""
        real = self.resolve(path)
        shutil.rmtree(real, ignore_errors=True)
        shutil.copytree(source, real, symlinks=True)
        self._hand_over(real)

    # -- commands ----------------------------------------------------------------------

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            wall_s: float | None = None) -> CommandResult:
        """Run `argv` in the folder under the limits; never raises for what the command does."""
        full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.root),
                    "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", **(env or {})}
        if self._site:
            paths = (full_env.get("PYTHONPATH"), str(self._site))
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        uid = self._command_uid()
        nproc = self.limits.processes + (0 if uid is not None else len(_processes_of(os.getuid())))
        proc = subprocess.Popen(list(argv), cwd=self.root, env=full_env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=functools.partial(self._confine_child, uid, nproc))
        reader = _OutputReader(proc.stdout, self.limits.output_bytes)
        timed_out = False
        try:
            proc.wait(timeout=wall_s or self.limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)  # also background processes that left the group and hold the pipe open
        proc.wait()
        # Without a uid of its own a process that left the group may still hold the pipe:
        # stop waiting for its output rather than for it.
        reader.join(timeout=None if uid is not None else 5.0)
        return CommandResult(returncode=None if timed_out else proc.returncode,
                             output=reader.text(), timed_out=timed_out, output_dropped=reader.dropped)

    def _command_uid(self) -> int | None:
        if self.gid is None:
            return None
        uid = _free_uid()
        self._uids.append(uid)
        return uid

    def _confine_child(self, uid: int | None, nproc: int) -> None:
        # Runs in the child between fork and exec: keep to plain system calls.
        lim = self.limits
        if self.mode.network == "netns":
            _enter_netns()
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.umask(0o002)  # files a command creates stay writable for the next command's uid
        _libc().personality(_ADDR_NO_RANDOMIZE)
        if uid is not None:
            _become(uid, self.gid)

    def _hand_over(self, path: Path) -> None:
        """Give the sandbox group write access to `path` (and everything under it)."""
        if self.gid is None:
            return
        for target in [path] + (sorted(path.rglob("*")) if path.is_dir() else []):
            if target.is_symlink():
                continue
            os.chown(target, -1, self.gid)
            extra = 0o2070 if target.is_dir() else 0o060  # setgid dirs: new files keep the group
            target.chmod(target.stat().st_mode & 0o7777 | extra)

    def _install_site(self) -> Path:
        site = Path(tempfile.mkdtemp(prefix="akv-site-"))
        site.chmod(0o755)
        (site / "sitecustomize.py").write_text(_NO_NET_SITE)
        (site / "sitecustomize.py").chmod(0o644)
        return site


class _OutputReader:
    """Drains a pipe in a thread, keeping only the first `limit` bytes."""

    def __init__(self, stream, limit: int):
        self._stream, self._limit = stream, limit
        self._kept = bytearray()
        self.dropped = 0
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while chunk := self._stream.read1(65536):
            room = self._limit - len(self._kept)
            self._kept += chunk[:max(room, 0)]
            self.dropped += max(len(chunk) - max(room, 0), 0)
        self._stream.close()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def text(self) -> str:
        text = self._kept.decode("utf-8", errors="replace")
        return text + (f"\n[... {self.dropped} more bytes of output dropped]" if self.dropped else "")


def _processes_of(uid: int) -> list[int]:
    """Live pids whose real uid is `uid` (zombies excluded: they wait for init to reap them).

    /proc/PID itself may be owned by root for some processes, so read the status file.
    """
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields["Uid"].split()[1]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_uid(uid: int) -> None:
    """Kill every process of `uid`; repeated while a fork bomb still forks."""
    for _ in range(100):
        if not _processes_of(uid):
            return
        _signal_all_as(uid)


def _signal_all_as(uid: int) -> None:
    """kill(-1) as `uid` signals exactly the processes of that uid, atomically, forkers included."""
    child = os.fork()
    if child == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _free_uid() -> int:
    while True:
        uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])
        if not _processes_of(uid):
            return uid
