"""Suite versions: a short stable id of a suite's built content and its build parameters.

`localcomp@e1-3f9a1c2b7d10`: the suite's name, its edition (the generator design, a build
parameter; 1 when the manifest names none), then 12 hex digits of a SHA-256 over the build
manifest (which holds every build parameter) and the digests of the built files. Two data folders
with the same version hold the same tasks; a rebuild with other parameters, or by a changed
generator, gives another. Runs record it, so a resume can refuse data that is not what the run
scored on.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Sequence

_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: big files are hashed once
VERSION = re.compile(r"^(?P<name>[\w-]+)@e(?P<edition>\d+)-(?P<digest>[0-9a-f]{12})$")


class SuiteNotBuilt(ValueError):
    """The data a version is computed from is missing; the message names the command that builds it."""


def content_version(name: str, manifest: Path, built: Sequence[Path]) -> str:
    """The version of suite `name` from its manifest and built files (all must exist)."""
    missing = [p for p in (manifest, *built) if not p.is_file()]
    if missing:
        raise SuiteNotBuilt(f"{name} is not built (missing {missing[0]}): run `akv tasks build --suite {name}`")
    text = manifest.read_bytes()
    digest = hashlib.sha256(b"manifest\0" + text)
    for path in built:
        digest.update(f"\0{path.name}\0".encode() + file_digest(path).encode())
    return f"{name}@e{edition_of(manifest_data(manifest))}-{digest.hexdigest()[:12]}"


def manifest_data(manifest: Path) -> dict[str, Any]:
    """The manifest as a mapping ({} when it is missing or unreadable)."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def edition_of(data: dict[str, Any]) -> int:
    """A manifest's edition: top level or under "config"; 1 (the first generator) when absent."""
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    return int(data.get("edition", config.get("edition", 1)))


def file_digest(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def rebuild_command(name: str, recorded: str, current: str | None, seed: int) -> str:
    """The command that rebuilds `recorded`'s data: the suite, its seed and, where editions are in play
    (the recorded one is not the first, or the built one differs from it), its edition."""
    command = f"akv tasks build --suite {name} --seed {seed}"
    wanted, built = VERSION.match(recorded), VERSION.match(current or "")
    if wanted and (wanted["edition"] != "1" or (built and built["edition"] != wanted["edition"])):
        command += f" --edition {wanted['edition']}"
    return command


def check_recorded(name: str, current: str | None, recorded: str, seed: int, folder: Path | None = None) -> None:
    """Raise ValueError unless the built data (`current`, None when missing) is the `recorded` version.

    Runs recorded before suites had versions (`NAME@unversioned`) cannot be checked and pass.
    `folder` (the suite's data folder) is named for the case a build cannot see: files changed
    under an unchanged manifest, which a build takes as current.
    """
    if recorded.endswith("@unversioned"):
        return
    command = rebuild_command(name, recorded, current, seed)
    if current is None:
        raise ValueError(f"suite {name}: the run was scored on {recorded}, but {name} is not built: "
                         f"run `{command}`, then resume")
    if current != recorded:
        hint = f" (if it reports the build as current, remove {folder} first)" if folder is not None else ""
        raise ValueError(f"suite {name}: the run was scored on {recorded}, but the built data is {current} "
                         f"(stale for this run): rebuild it with `{command}`{hint}, then resume")
