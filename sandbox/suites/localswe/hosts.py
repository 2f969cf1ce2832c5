"""The host projects: pinned source archives from PyPI, fetched, verified and unpacked.

The lock file `hosts.json` names each project, its version, the archive's sha256, where its
code and tests live, and what goes on PYTHONPATH. Tests always run against a task's copy of
the tree (PYTHONPATH = the copy), never against an installed package.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = Path(__file__).with_name("hosts.json")


class BuildError(ValueError):
    """The suite cannot be built (an archive missing, corrupt or unreachable)."""


@dataclass(frozen=True)
class Host:
    name: str
    version: str
    archive: str
    sha256: str
    pythonpath: str  # relative to the tree root
    source: str  # the package folder bugs are injected into
    tests: tuple[str, ...]  # test folders, relative to the tree root

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    def is_test_file(self, relpath: str) -> bool:
        return any(relpath == t or relpath.startswith(t.rstrip("/") + "/") for t in self.tests)


def load_hosts() -> list[Host]:
    data = json.loads(LOCK_FILE.read_text())
    return [Host(h["name"], h["version"], h["archive"], h["sha256"], h["pythonpath"], h["source"],
                 tuple(h["tests"])) for h in data["hosts"]]


def fetch(host: Host, archives: Path) -> Path:
    """The verified archive of `host` under `archives`, downloaded with pip when missing."""
    path = archives / host.archive
    if not path.exists():
        archives.mkdir(parents=True, exist_ok=True)
        spec = f"{host.name}=={host.version}"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                               ":all:", spec, "-d", str(archives)], capture_output=True, text=True)
        if done.returncode != 0 or not path.exists():
            last = (done.stderr.strip().splitlines() or ["no archive written"])[-1]
            raise BuildError(f"could not fetch {spec} from PyPI: {last}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != host.sha256:
        raise BuildError(f"{path.name}: sha256 {digest} does not match the lock file ({host.sha256})")
    return path


def unpack(host: Host, archive: Path, trees: Path) -> Path:
    """The pristine source tree of `host` (unpacked once; a half-written tree is redone)."""
    tree = trees / host.key
    done = tree / ".unpacked"
    if done.exists():
        return tree
    shutil.rmtree(tree, ignore_errors=True)
    staging = trees / f".{host.key}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")  # the data filter refuses links and paths out of the folder
    shutil.move(str(staging / host.key), tree)
    shutil.rmtree(staging, ignore_errors=True)
    done.write_text(host.sha256)
    return tree


def source_files(host: Host, tree: Path) -> list[str]:
    """The host's own modules (tests excluded), relative to the tree root, sorted."""
    files = []
    for path in sorted((tree / host.source).rglob("*.py")):
        rel = path.relative_to(tree).as_posix()
        if not host.is_test_file(rel) and "/tests/" not in rel:
            files.append(rel)
    return files
