"""Where compiled kernels live, and what is checked before one is loaded into the process.

A shared object loaded with ctypes runs with the user's rights, so it is built into, and loaded only
from, a per-user folder that no other user can write: `$AKV_KERNEL_CACHE` (an override for tests),
else `$XDG_CACHE_HOME/akv/kernels`, else `~/.cache/akv/kernels`, created with mode 0700. The data
folder (`AKV_HOME`, by default in the working directory) is never used for libraries: running in a
folder someone else prepared must not load their code.

Each build's SHA-256 is recorded beside it (`<name>.json`, written atomically once the library is in
place) and compared before every load. `load` refuses, raising `Unavailable` with the reason and
the fix (the caller then keeps torch's kernels and reports both), when the folder, a folder above it, the library or
its record is owned by another user or writable by group or others (a folder above it must belong to
this user or root, and may be writable by others only with the sticky bit, as /tmp, and by its group
only then or when the group is this user's alone), or the library's digest differs from the record.
A library without a record is rebuilt (a build writes a fresh record); one whose digest differs is not,
so that a changed file is reported instead of silently replaced.
"""
from __future__ import annotations

import ctypes
import fcntl
import grp
import hashlib
import json
import os
import pwd
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "AKV_KERNEL_CACHE"


class Unavailable(Exception):
    """A library that is not loaded: the message says why, `fix` what makes the next start load one (shown by
    the caller's `why_unavailable`)."""

    def __init__(self, reason: str, fix: str | None = None) -> None:
        super().__init__(reason)
        self.fix = fix


def _rebuilt(library: Path) -> str:
    """The fix for a library or record that cannot be trusted: remove both, and the next start builds anew."""
    return f"rm {library} {record_path(library)} (both are built again at the next start)"


def cache_folder() -> Path:
    """The per-user kernel folder (not created): `$AKV_KERNEL_CACHE`, `$XDG_CACHE_HOME/akv/kernels` or
    `~/.cache/akv/kernels` (a relative XDG_CACHE_HOME is ignored, as the XDG specification says)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "akv" / "kernels"
    try:
        return Path.home() / ".cache" / "akv" / "kernels"
    except RuntimeError as error:   # no HOME and no passwd entry
        raise Unavailable(f"no home folder for the kernel cache ({error})",
                          f"set XDG_CACHE_HOME or {CACHE_ENV} to a folder of your own") from error


def _owner_problem(path: Path, info: os.stat_result, what: str) -> str | None:
    """Why `path` (the kernel folder, a library or its record) cannot be trusted, or None."""
    uid = os.geteuid()
    if info.st_uid != uid:
        return f"the kernel {what} {path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & 0o022:
        return (f"the kernel {what} {path} is writable by group or others "
                f"(mode {stat.S_IMODE(info.st_mode):04o})")
    return None


def _private_group(gid: int) -> bool:
    """Whether group `gid` has this user as its only member (the user private group most distributions give each
    user, where a umask of 002 makes folders group-writable): its write bit then lets no one else in. The rule
    Debian's OpenSSH applies to a group-writable home; asked only for such a folder, so the scan is rare."""
    uid = os.geteuid()
    try:
        members = set(grp.getgrgid(gid).gr_mem)
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    primary = {entry.pw_uid for entry in pwd.getpwall() if entry.pw_gid == gid}
    return bool(primary or members) and primary <= {uid} and members <= {name}


def _ancestor_problem(path: Path, info: os.stat_result) -> str | None:
    """Why a folder above the kernel folder lets another user swap the kernel folder for their own, or None:
    it must belong to this user or root, and be writable by others only with the sticky bit (as /tmp), by its
    group only with the sticky bit or when that group is this user's alone."""
    if info.st_uid not in (os.geteuid(), 0):
        return f"{path}, above the kernel folder, is owned by uid {info.st_uid} (another user could replace it)"
    sticky = info.st_mode & stat.S_ISVTX
    if info.st_mode & 0o002 and not sticky:
        return (f"{path}, above the kernel folder, is writable by others without the sticky bit "
                f"(mode {stat.S_IMODE(info.st_mode):04o})")
    if info.st_mode & 0o020 and not sticky and not _private_group(info.st_gid):
        return (f"{path}, above the kernel folder, is writable by group {info.st_gid}, which has other members "
                f"(mode {stat.S_IMODE(info.st_mode):04o})")
    return None


def private_folder(folder: Path | None = None) -> Path:
    """The kernel folder (default `cache_folder()`), symlinks resolved, created 0700 with any missing folder
    above it, and checked (module docstring); Unavailable otherwise."""
    folder = (folder or cache_folder()).resolve()
    for missing in reversed([p for p in (folder, *folder.parents) if not os.path.lexists(p)]):
        try:
            os.mkdir(missing, 0o700)
        except FileExistsError:   # another process made it meanwhile: checked below like any other
            pass
    info = os.lstat(folder)
    # Another user may have put a library and its record there: the folder is made again, not just closed.
    fix = (f"rm -r {folder} (it is made again, private, with a fresh build, at the next start), or set {CACHE_ENV} "
           "to a folder of your own")
    if not stat.S_ISDIR(info.st_mode):
        raise Unavailable(f"the kernel folder {folder} is not a folder", fix)
    problem = _owner_problem(folder, info, "folder")
    if problem:
        raise Unavailable(f"{problem}; the library there is not loaded", fix)
    problem = next(filter(None, (_ancestor_problem(p, os.stat(p)) for p in folder.parents)), None)
    if problem:
        raise Unavailable(f"{problem}; the library there is not loaded",
                          f"set {CACHE_ENV} to a folder under folders only you can write")
    return folder


def _open_checked(path: Path, what: str) -> int:
    """A read-only descriptor of the regular file `path` (never through a symlink), checked like the folder."""
    fix = _rebuilt(path if what == "library" else path.with_suffix(".so"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)   # a FIFO must not block
    except OSError as error:
        raise Unavailable(f"the kernel {what} {path} cannot be opened ({error.strerror}); not loaded", fix) from error
    info = os.fstat(fd)
    problem = None if stat.S_ISREG(info.st_mode) else f"the kernel {what} {path} is not a regular file"
    problem = problem or _owner_problem(path, info, what)
    if problem:
        os.close(fd)
        raise Unavailable(f"{problem}; not loaded", fix)
    return fd


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def record_path(library: Path) -> Path:
    """Where the digest of `library` is recorded: beside it, `<name>.json`."""
    return library.with_suffix(".json")


def record(library: Path) -> str:
    """Record the SHA-256 of `library` beside it, atomically (a reader sees the old record or the new one,
    never half of one); returns the digest."""
    fd = _open_checked(library, "library")
    try:
        digest = _sha256(fd)
    finally:
        os.close(fd)
    text = json.dumps({"file": library.name, "sha256": digest}) + "\n"
    handle, temporary = tempfile.mkstemp(dir=library.parent, prefix=".record-")   # mode 0600
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, record_path(library))
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return digest


def _recorded_digest(library: Path) -> str:
    """The digest recorded for `library`, the record checked like the library itself."""
    path = record_path(library)
    fd = _open_checked(path, "record")
    try:
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = json.loads(stream.read(1 << 16))
    except ValueError as error:
        raise Unavailable(f"the kernel record {path} is not valid JSON; not loaded", _rebuilt(library)) from error
    finally:
        os.close(fd)
    digest = data.get("sha256") if isinstance(data, dict) else None
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise Unavailable(f"the kernel record {path} holds no SHA-256; not loaded", _rebuilt(library))
    return digest


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held while one process checks, builds and loads a library: another one waits, then finds it built."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(library: Path, build: Callable[[Path], None]) -> None:
    """`build(path)` into a private temporary folder beside `library`, then renamed over it (mode 0700,
    whatever the umask) and recorded."""
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".build-") as tmp:
        built = Path(tmp) / library.name
        build(built)
        os.chmod(built, 0o700)
        os.replace(built, library)
    record(library)


def load(name: str, build: Callable[[Path], None], folder: Path | None = None) -> ctypes.CDLL:
    """The library `<name>.so` from the kernel folder (default `cache_folder()`), built with `build(path)`
    (which raises Unavailable when it cannot) where it or its record is missing, loaded only once the checks
    of the module docstring hold; Unavailable with the reason otherwise."""
    folder = private_folder(folder)
    library = folder / f"{name}.so"
    # The folder and every folder above it are this user's (or root's, or sticky): no other user can rename
    # or replace the library between the digest check and the load below, and the lock keeps this user's
    # other processes from rebuilding it meanwhile.
    with _locked(folder / f"{name}.lock"):
        if not (os.path.lexists(library) and os.path.lexists(record_path(library))):
            _build(library, build)
        expected = _recorded_digest(library)
        fd = _open_checked(library, "library")
        try:
            found = _sha256(fd)
        finally:
            os.close(fd)
        if found != expected:
            raise Unavailable(f"the kernel library {library} has SHA-256 {found[:16]}..., not {expected[:16]}... as "
                              f"recorded when it was built: it changed since; not loaded", _rebuilt(library))
        return ctypes.CDLL(str(library))
