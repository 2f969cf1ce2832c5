"""The host as a task command sees it: read-only, its secrets hidden, a private /tmp.

A command runs under bubblewrap (`bwrap`) in its own mount namespace built from one rule per
path, applied from the shallowest path to the deepest so that the most specific rule wins:

- `/` read-only, with a fresh `/dev` and a `/proc` of the command's own pid namespace;
- hidden folders (root's and our home, the data folder, the temporary folder where the other
  task copies live, `/tmp`) replaced by empty size-limited tmpfs; `/tmp` is world-writable
  and private to the command, so what it writes there is gone when it ends;
- hidden files (`/etc/shadow` and its kin) replaced by `/dev/null` on a nodev mount (unreadable);
- the interpreter (its prefixes and site-packages, which may live inside a hidden folder such
  as `/root/.pyenv`) read-only again, so the host project's tests run on the same Python;
- the task folder, read-write.

The view holds paths only; `bwrap_argv` turns it into bubblewrap's options.
"""
from __future__ import annotations

import os
import site
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from akv_core.home import akv_home

_SECRET_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-")


@dataclass(frozen=True)
class HostView:
    hidden: tuple[Path, ...]  # folders replaced by an empty tmpfs
    hidden_files: tuple[Path, ...]  # files replaced by /dev/null
    exposed: tuple[Path, ...]  # read-only again, even inside a hidden folder
    private_tmp: Path = Path("/tmp")  # hidden too, but writable by anyone: the command's own /tmp


def host_view() -> HostView:
    """The view for commands started now (the data folder is read from AKV_HOME at each call)."""
    home = os.path.expanduser("~")  # unchanged when the user has no home
    hidden = {"/root", home, str(akv_home().resolve()), tempfile.gettempdir(), "/tmp"}
    # Never "/" (a service account's home may be): that would hide the whole host.
    hidden_now = tuple(p for p in _existing(h for h in hidden if os.path.isabs(h)) if p != Path("/"))
    # Outside the hidden folders the interpreter is visible already (read-only, with the host).
    exposed = [p for p in _outermost(_existing(interpreter_paths())) if any(h in p.parents for h in hidden_now)]
    return HostView(hidden=hidden_now, hidden_files=_existing(Path(p) for p in _SECRET_FILES),
                    exposed=tuple(exposed))


def interpreter_paths() -> set[Path]:
    """What running `sys.executable` needs: its prefixes, site-packages and the executable's folder.

    Not sys.path as a whole: its first entry may be the working directory, which holds the data
    folder, and exposing it would show what `hidden` hides.
    """
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return {Path(p) for p in prefixes | set(site.getsitepackages())} | {
        Path(os.path.realpath(sys.executable)).parent}


def bwrap_argv(bwrap: str, view: HostView, root: Path, tmp_bytes: int, *, user_namespace: bool) -> list[str]:
    """bubblewrap's options for running a command in `root` under `view` (the command follows).

    Run as root, bwrap needs no user namespace (and the command then switches uid itself);
    otherwise it creates one, mapping our uid to itself.
    """
    argv = [bwrap, *_namespaces(user_namespace), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    rules = [(p, "tmpfs") for p in view.hidden] + [(p, "null") for p in view.hidden_files]
    rules += [(p, "ro") for p in view.exposed] + [(root, "rw")]
    tmpfs = {p for p, kind in rules if kind == "tmpfs"}
    for path, kind in sorted(rules, key=lambda rule: (len(rule[0].parts), str(rule[0]))):
        argv += _missing_folders(path, tmpfs, {p for p, _ in rules})
        if kind == "tmpfs":
            mode = "1777" if path == view.private_tmp else "0755"
            argv += ["--perms", mode, "--size", str(tmp_bytes), "--tmpfs", str(path)]
        elif kind == "null":
            argv += ["--ro-bind", "/dev/null", str(path)]
        else:
            argv += ["--ro-bind" if kind == "ro" else "--bind", str(path), str(path)]
    return argv + ["--chdir", str(root)]


def trial_argv(bwrap: str, *, user_namespace: bool) -> list[str]:
    """A trivial command (`true`) in the namespaces a task command gets: whether bubblewrap can start here."""
    return [bwrap, *_namespaces(user_namespace), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true"]


def _namespaces(user_namespace: bool) -> list[str]:
    """bubblewrap's options for the namespaces of a command (a user namespace when not root)."""
    options = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session"]
    return options + (["--unshare-user"] if user_namespace else [])


def _missing_folders(path: Path, tmpfs: set[Path], mounted: set[Path]) -> list[str]:
    """Folders to create (0755: every uid must pass) between the enclosing tmpfs and `path`.

    Below a bind mount the host's own folders are there already; bubblewrap would create the
    missing ones 0700, which the command's uid could not enter.
    """
    enclosing = max((m for m in mounted if m != path and m in path.parents), key=lambda m: len(m.parts),
                    default=None)
    if enclosing not in tmpfs:
        return []
    between = [p for p in reversed(path.parents) if enclosing in p.parents]
    return [arg for folder in between for arg in ("--perms", "0755", "--dir", str(folder))]


def _existing(paths) -> tuple[Path, ...]:
    return tuple(sorted({Path(os.path.realpath(p)) for p in paths if os.path.lexists(p)}))


def _outermost(paths: tuple[Path, ...]) -> tuple[Path, ...]:
    """Drop the paths that lie inside another one of them (their parent's bind covers them)."""
    return tuple(p for p in paths if not any(q in p.parents for q in paths))
