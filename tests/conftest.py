"""Suite-wide set-up: the localcomp task suite that several layers' tests run on, a host folder for
the sandbox's tests and a throwaway PostgreSQL server for the store's.

The suite is built once into the data folder (AKV_HOME, default `.akv/`); a built folder is reused,
so only a fresh checkout pays the build (about a minute on two cores).

`make test` runs the files on two processes (pytest-xdist, `--dist loadfile`: a file's tests and its
module fixtures stay on one process). Each process gets its own data folder under the caller's
(`AKV_HOME/xdist-gw0`, ...), so no two processes build, write or read the same suite or database
at once; a run without xdist keeps the caller's folder.
"""
from __future__ import annotations

import ctypes
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        home = Path(os.environ.get("AKV_HOME", ".akv")).expanduser().resolve() / f"xdist-{worker}"
        home.mkdir(parents=True, exist_ok=True)
        os.environ["AKV_HOME"] = str(home)


@pytest.fixture(scope="session", autouse=True)
def localcomp_built() -> None:
    from akv_core.home import akv_home
    from sandbox.suites import get_suite

    get_suite("localcomp").build(akv_home(), 0)


@pytest.fixture(scope="module", autouse=True)
def release_memory_after_each_file():
    """A file's models are let go when it ends (`test_model_support.release_models`), and the freed
    memory handed back to the system: each test process otherwise grows by every model any of its
    files loaded, past what two of them can hold on this machine."""
    yield
    support = sys.modules.get("test_model_support")
    if support is not None:
        support.release_models()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the memory stays with the process until it reuses it


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
    """A private PostgreSQL cluster on loopback (benchmarks/postgres.py); yields the admin URL."""
    from benchmarks import postgres

    reason = postgres.missing()
    if reason:
        pytest.skip(f"PostgreSQL tests: {reason}")
    with postgres.throwaway_cluster() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The URL of a new, empty database on the throwaway server."""
    from benchmarks.postgres import fresh_database

    return fresh_database(postgres_server)
