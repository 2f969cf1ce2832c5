"""Suite-wide set-up: the localcomp task suite that several layers' tests run on, a host folder for
the sandbox's tests and a throwaway PostgreSQL server for the store's.

The suite is built once into the data folder (AKV_HOME, default `.akv/`); a built folder is reused,
so only a fresh checkout pays the build (about a minute on two cores).
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
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def localcomp_built() -> None:
    from akv_core.home import akv_home
    from sandbox.suites import get_suite

    get_suite("localcomp").build(akv_home(), 0)


@pytest.fixture
def host_folder():
    """A host folder outside /tmp (which the sandbox hides): one a task command sees but must not change."""
    if not Path("/var/tmp").is_dir():
        pytest.skip("needs /var/tmp for a host folder that task commands can see")
    folder = Path(tempfile.mkdtemp(prefix="akv-host-", dir="/var/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="session")
def postgres_server():
    """A private PostgreSQL cluster on loopback; yields the admin URL."""
    initdb = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb")]
    if not initdb[-1] or importlib.util.find_spec("psycopg") is None:
        pytest.skip("PostgreSQL tests need the server binaries (apt-get install postgresql) and psycopg "
                    "(pip install 'akv[postgres]')")
    bindir = Path(initdb[-1]).parent
    folder = Path(tempfile.mkdtemp(prefix="akv-pg-"))
    folder.chmod(0o777)  # the server refuses to run as root; it runs as the postgres user
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
    import psycopg

    name = f"akv_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{server}/{name}"


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The URL of a new, empty database on the throwaway server."""
    return fresh_database(postgres_server)
