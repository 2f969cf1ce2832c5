"""Running untrusted commands inside a task folder without risk to the host.

A `Sandbox` owns one fresh folder. Every command it runs gets:

- resource limits: CPU time, address space, file size, no core dumps (setrlimit);
- a process-count limit. RLIMIT_NPROC counts processes per *user* and is not enforced for
  root, so when we run as root each command gets its own unused unprivileged uid: the
  command runs as that uid, the limit then holds, the uid owns nothing else on the host
  (it can write only the sandbox folder, through the sandbox's group), and every process it
  leaves behind can be found and killed by uid, even ones that left the process group;
- its own view of the host (`sandbox.isolation.hostview`, under bubblewrap): its own mount, pid, ipc
  and network namespaces, the host read-only, secrets hidden (home folders, `/etc/shadow`,
  the data folder, the other task copies), a private `/tmp` discarded when it ends, no
  capabilities at all (as root, bubblewrap sets the mounts up and `setpriv` then drops to
  the command's uid with empty capability sets, including the bounding set);
- without bubblewrap (not installed, or unable to start: user namespaces off), no command at
  all: `SandboxUnavailable` says what is missing and how to fix it. Only the explicit opt-out
  `AKV_UNSAFE_NO_SANDBOX=1` (for people who run us inside a container of their own) runs
  commands without it, under the weaker mechanism we had before, with one warning per process:
  the uid keeps CAP_DAC_READ_SEARCH (read and search anywhere, write nothing) because the
  interpreter may live in a folder only root can enter, `/tmp` is shared, and the network is
  cut by a fresh network namespace when the kernel lets us create one, otherwise by a
  `sitecustomize` that refuses Python-level socket connections (it does not stop a C program);
- no_new_privs, so setuid programs cannot give root back;
- a wall timeout after which every process of the command is killed (not root: its
  process group, and under bubblewrap its whole pid namespace). The CPU-time limit is what
  stops runaway code; the wall timeout is a backstop for code that hangs without using CPU.
  How long a command takes on the wall clock depends on the machine's load, so a caller whose
  results must be reproducible treats its expiry as `WallClockExpired`, never as an outcome;
- bounded output: the first `output_bytes` of stdout+stderr are kept, the rest counted;
- no address-space randomization (personality ADDR_NO_RANDOMIZE): Python 3.11 hashes
  None by its address, so with ASLR a test suite parametrized from a set of tuples gets
  different test ids on every run. Reproducible runs matter more to us than ASLR inside
  a sandbox that already has no network and owns nothing.

Paths given by an agent are confined with `Sandbox.resolve`: symlinks resolved, no `..`,
no absolute path outside the folder. `containment()` says what this machine enforces;
bubblewrap is probed once per process (a trivial run, then our interpreter under the full view).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from sandbox.isolation.hostview import bwrap_argv, host_view, trial_argv

_CLONE_NEWNET = 0x40000000
_ADDR_NO_RANDOMIZE = 0x0040000
_LOG = logging.getLogger(__name__)
UNSAFE_ENV = "AKV_UNSAFE_NO_SANDBOX"  # "1": run task commands on the host, unconfined (own container only)
_WARNED = threading.Event()  # the opt-out's warning: once per process
_PROBING = threading.Lock()
_COMMAND_PATH = "/usr/local/bin:/usr/bin:/bin"
_INSTALL = "Install it: `apt-get install bubblewrap` (Debian, Ubuntu; `make setup` does it when run as root)."
_NAMESPACES = ("Let it create namespaces: enable unprivileged user namespaces (`sysctl -w "
               "kernel.unprivileged_userns_clone=1` on Debian, `user.max_user_namespaces` above 0; on Ubuntu 23.10 "
               "and later `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile that "
               "allows bwrap), or start the container it runs in with the rights to create namespaces.")
_VIEW = ("bubblewrap starts, but our interpreter does not run in the view of the host task commands get "
         "(sandbox/isolation/hostview.py): install it and its packages where every user can read them, outside "
         "the home folders, the data folder and the temporary folder.")
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


class SandboxUnavailable(ValueError):
    """Task commands cannot run here: bubblewrap is missing or cannot start, and the opt-out is not set.

    A ValueError: a build stops with it as one line, and a task run ends as an error with it.
    """


class WallClockExpired(RuntimeError):
    """A command ran past its wall-clock backstop: what it would have given depends on the machine's load.

    Raised by callers that must stay reproducible (a task's tools and grade), so that the run
    ends as an error naming the backstop instead of continuing on a load-dependent result.
    """


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 60
    wall_s: float = 120.0
    memory_bytes: int = 2 << 30
    file_bytes: int = 64 << 20
    processes: int = 64
    output_bytes: int = 256 << 10
    tmp_bytes: int = 256 << 20  # the private /tmp (memory), under bubblewrap


@dataclass(frozen=True)
class Containment:
    """What this machine enforces; `processes`, `network` and `host` name the mechanism."""

    processes: str  # "own-uid" (root) or "user-rlimit" (non-root: counts all our processes)
    network: str  # "netns" or "python-only"
    host: str  # "bwrap" (own mount namespace, no capabilities) or "shared" (the host as it is)
    note: str = ""  # why bubblewrap is not used, when it is not

    def describe(self) -> str:
        text = f"processes: {self.processes}, network: {self.network}, host: {self.host}"
        return f"{text} ({self.note})" if self.note else text

    @property
    def weakness(self) -> str | None:
        """One line on what task commands can do to the host here, or None when it is contained."""
        if self.host == "bwrap":
            return None
        reach = ("keep CAP_DAC_READ_SEARCH and can read every file of the host" if self.processes == "own-uid"
                 else "run with your own permissions and can read your files")
        network = "" if self.network == "netns" else ", only Python code is kept off the network"
        return f"task commands are not isolated from the host: {self.note}; they {reach}{network}, and /tmp is shared"


@dataclass(frozen=True)
class CommandResult:
    returncode: int | None  # None when killed by the wall timeout
    output: str  # stdout and stderr interleaved, cut at Limits.output_bytes
    timed_out: bool
    output_dropped: int  # bytes of output beyond the limit
    wall_s: float = 0.0  # the wall limit it ran under

    def check_wall_clock(self, what: str) -> None:
        """WallClockExpired when the command was killed by its wall timeout."""
        if self.timed_out:
            raise WallClockExpired(f"{what} ran past its {self.wall_s:g} s wall-clock backstop (the CPU limit stops "
                                   "runaway code; this one hung or the machine is overloaded): the task is not scored "
                                   "on a load-dependent outcome")

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


def containment() -> Containment:
    """The mechanism task commands run under: bubblewrap, or the host as it is with the opt-out.

    SandboxUnavailable, naming what is missing and what to do, when bubblewrap cannot run here
    and `AKV_UNSAFE_NO_SANDBOX=1` is not set. The opt-out is read at each call; probes run once.
    """
    if unsafe_no_sandbox():
        return _unconfined(f"{UNSAFE_ENV}=1 turns the sandbox off")
    problem = _bwrap_problem()
    if problem is not None:
        raise _refusal(*problem)
    return _isolated()


def containments() -> tuple[Containment, ...]:
    """Every mechanism that works here, strongest first (tests and benchmarks compare them).

    The host as it is (`host="shared"`) is always last; a sandbox runs commands under it only
    with the opt-out set.
    """
    failure = bwrap_failure()
    shared = _unconfined(failure or "bubblewrap works here but is not used")
    return (shared,) if failure else (_isolated(), shared)


def unsafe_no_sandbox() -> bool:
    """Whether `AKV_UNSAFE_NO_SANDBOX=1` asks to run task commands on the host, unconfined (read now)."""
    value = os.environ.get(UNSAFE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{UNSAFE_ENV}={value!r}: expected 1 (run task commands without the sandbox) or 0 (or unset)")


def set_unsafe_no_sandbox() -> None:
    """The opt-out for this process and every process it starts (what `--unsafe-no-sandbox` does)."""
    os.environ[UNSAFE_ENV] = "1"


def bwrap_failure() -> str | None:
    """Why bubblewrap cannot confine task commands here, or None when it can (probed once per process)."""
    problem = _bwrap_problem()
    return problem[0] if problem else None


@functools.lru_cache(maxsize=1)
def _mechanisms() -> tuple[str, str]:
    """(processes, network): what this machine lets a command's process limit and network cut use."""
    processes = "own-uid" if _works(lambda: _become(_free_uid(), _free_uid())) else "user-rlimit"
    network = "netns" if _works(_enter_netns) else "python-only"
    return processes, network


def _isolated() -> Containment:
    return Containment(processes=_mechanisms()[0], network="netns", host="bwrap")


def _unconfined(note: str) -> Containment:
    processes, network = _mechanisms()
    return Containment(processes=processes, network=network, host="shared", note=note)


def _bwrap_problem() -> tuple[str, str] | None:
    """(why bubblewrap cannot confine task commands here, what to do about it), or None when it can."""
    with _PROBING:  # tasks opened at once by several threads wait for the one probe
        return _probe_bwrap()


@functools.lru_cache(maxsize=1)
def _probe_bwrap() -> tuple[str, str] | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (no `bwrap` on PATH)", _INSTALL
    own_uid = _mechanisms()[0] == "own-uid"
    if own_uid and shutil.which("setpriv") is None:
        return "setpriv is not installed (no `setpriv` on PATH)", "Install util-linux: `apt-get install util-linux`."
    failure = _trial_failure(bwrap, user_namespace=not own_uid)
    if failure:
        return failure, _NAMESPACES
    failure = _interpreter_failure()
    return (failure, _VIEW) if failure else None


def _trial_failure(bwrap: str, *, user_namespace: bool) -> str | None:
    """Why a trivial command under bubblewrap fails here (with bubblewrap's own words), or None."""
    argv = trial_argv(bwrap, user_namespace=user_namespace)
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                              env={"PATH": _COMMAND_PATH})
    except subprocess.TimeoutExpired:
        return f"bubblewrap ({bwrap}) cannot start here: a trivial run did not end within 30 s"
    except OSError as error:
        return f"bubblewrap ({bwrap}) cannot start here: {error}"
    if done.returncode == 0:
        return None
    said = " ".join(done.stderr.decode(errors="replace").split())[:300] or "nothing on stderr"
    return f"bubblewrap ({bwrap}) cannot start here: a trivial run exited with status {done.returncode} ({said})"


def _interpreter_failure() -> str | None:
    """Why bubblewrap cannot run our interpreter in the full host view, or None (a real sandboxed run)."""
    expected = f"{sys.version} {sys.prefix}"
    folder = Path(tempfile.mkdtemp(prefix="akv-probe-"))
    folder.chmod(0o755)
    with Sandbox(folder, Limits(cpu_s=10, wall_s=30.0), mode=_isolated()) as probe:  # closing removes the folder
        result = probe.run([sys.executable, "-c", "import sys; print(sys.version, sys.prefix)"])
    if result.returncode == 0 and result.output.strip() == expected:
        return None
    first = (result.output.strip().splitlines() or [result.summary()])[0]
    return f"bubblewrap does not run our interpreter here: {first[:200]}"


def _refusal(reason: str, remedy: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"task commands cannot run: {reason}. They run only under bubblewrap, which keeps the host's files "
        f"away from them. {remedy} To run them unconfined instead, and only inside a container or virtual "
        f"machine of your own that holds nothing they must not read, set {UNSAFE_ENV}=1 (or pass "
        f"--unsafe-no-sandbox).")


def _allow(mode: Containment) -> None:
    """SandboxUnavailable unless `mode` confines commands or the opt-out is set (then one warning per process)."""
    if mode.host == "bwrap":
        return
    if not unsafe_no_sandbox():
        raise SandboxUnavailable(f"task commands cannot run on the host as it is ({mode.note}) unless "
                                 f"{UNSAFE_ENV}=1 is set (or --unsafe-no-sandbox passed)")
    if not _WARNED.is_set():
        _WARNED.set()
        _LOG.warning("sandbox: %s", mode.weakness)


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
    """Switch to `uid`, keeping only CAP_DAC_READ_SEARCH (ambient, so it survives exec).

    The mechanism without bubblewrap: the interpreter may live under a folder only root can enter.
    """
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

    def __init__(self, root: Path, limits: Limits = Limits(), mode: Containment | None = None):
        self.root = root.resolve()
        self.limits = limits
        self.mode = mode or containment()
        _allow(self.mode)
        self.gid = _free_uid() if self.mode.processes == "own-uid" else None
        self._uids: list[int] = []
        self._site = self._install_site() if self.mode.network != "netns" else None
        self._hand_over(self.root)

    @classmethod
    def copy_of(cls, source: Path, limits: Limits = Limits(), prefix: str = "akv-task-",
                mode: Containment | None = None) -> "Sandbox":
        """A sandbox whose folder is a fresh copy of `source` (symlinks copied as links)."""
        mode = mode or containment()  # SandboxUnavailable before anything is copied
        _allow(mode)
        parent = Path(tempfile.mkdtemp(prefix=prefix))
        parent.chmod(0o755)  # the command uids must reach the folder
        root = parent / "repo"
        shutil.copytree(source, root, symlinks=True)
        return cls(root, limits, mode)

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
        """Run `argv` in the folder under the limits; never raises for what the command does.

        SandboxUnavailable when the sandbox's mode no longer confines commands without the opt-out.
        """
        _allow(self.mode)
        full_env = {"PATH": _COMMAND_PATH, "HOME": str(self.root),
                    "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", **(env or {})}
        if self._site:
            paths = (full_env.get("PYTHONPATH"), str(self._site))
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        uid = self._command_uid()
        nproc = self.limits.processes + (0 if uid is not None else len(_processes_of(os.getuid())))
        if self.mode.host == "bwrap":
            argv = self._under_bwrap(argv, uid)
            nproc += 2 if uid is None else 0  # bubblewrap's own two processes run as us
        proc = subprocess.Popen(list(argv), cwd=self.root, env=full_env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=functools.partial(self._confine_child, uid, nproc))
        reader = _OutputReader(proc.stdout, self.limits.output_bytes)
        timed_out, limit = False, wall_s or self.limits.wall_s
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)  # also background processes that left the group and hold the pipe open
        proc.wait()
        # Without a uid of its own a process that left the group may still hold the pipe:
        # stop waiting for its output rather than for it.
        reader.join(timeout=None if uid is not None else 5.0)
        returncode = proc.returncode if self.mode.host != "bwrap" else _signal_from_status(proc.returncode)
        return CommandResult(returncode=None if timed_out else returncode,
                             output=reader.text(), timed_out=timed_out, output_dropped=reader.dropped, wall_s=limit)

    def _command_uid(self) -> int | None:
        if self.gid is None:
            return None
        uid = _free_uid()
        self._uids.append(uid)
        return uid

    def _under_bwrap(self, argv: Sequence[str], uid: int | None) -> list[str]:
        """`argv` run by bubblewrap in the host view; as root, setpriv then becomes `uid`."""
        wrapped = bwrap_argv(shutil.which("bwrap"), host_view(), self.root, self.limits.tmp_bytes,
                             user_namespace=uid is None)
        if uid is not None:
            wrapped += [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={self.gid}", "--clear-groups",
                        "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return wrapped + list(argv)

    def _confine_child(self, uid: int | None, nproc: int) -> None:
        # Runs in the child between fork and exec: keep to plain system calls.
        lim = self.limits
        # bubblewrap makes the namespaces itself and, as root, needs root to mount: no uid switch here.
        bwrap = self.mode.host == "bwrap"
        if self.mode.network == "netns" and not bwrap:
            _enter_netns()
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.umask(0o002)  # files a command creates stay writable for the next command's uid
        _libc().personality(_ADDR_NO_RANDOMIZE)
        if bwrap and uid is None:
            _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        elif uid is not None and not bwrap:
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


def _signal_from_status(status: int) -> int:
    """bubblewrap exits 128+N when its command died of signal N: give it back as -N, like Popen."""
    if status > 128 and status - 128 in signal.valid_signals():
        return -(status - 128)
    return status


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
