"""A throwaway PostgreSQL cluster on loopback, for the store's tests and the scale benchmark.

Debian's server binaries (`apt-get install postgresql`) are found under /usr/lib/postgresql; the
cluster lives in a temporary folder, trusts local connections for the user `akv`, and is stopped
and removed on exit. As root the server runs as the `postgres` user (it refuses to run as root).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if not _initdb() or importlib.util.find_spec("psycopg") is None:
        return ("PostgreSQL needs the server binaries (apt-get install postgresql) and psycopg "
                "(pip install 'akv[postgres]')")
    return None


def _initdb() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb")]
    return found[-1]


@contextmanager
def throwaway_cluster() -> Iterator[str]:
    """Start a private cluster on a free loopback port; yields its admin URL (no database name)."""
    reason = missing()
    if reason:
        raise RuntimeError(reason)
    bindir = Path(_initdb()).parent
    folder = Path(tempfile.mkdtemp(prefix="akv-pg-"))
    folder.chmod(0o777)  # the server runs as the postgres user when we are root
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(folder / "data"), "-A", "trust", "-U", "akv"],
                   check=True, capture_output=True)
    subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(folder / "data"), "-l", str(folder / "log"), "-w",
                    "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql://akv@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def fresh_database(server: str) -> str:
    """A new, empty database on the cluster; its URL."""
    import psycopg

    name = f"akv_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"
