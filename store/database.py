"""Opening a database by URL: SQLite (WAL) in the data folder by default, PostgreSQL by URL."""
from __future__ import annotations

import importlib.util
import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from store.errors import StoreError

DEFAULT_DB_FILE = "akv.db"


def default_url(create_folder: bool = True) -> str:
    """`AKV_DB` if set, else the SQLite file in the data folder (the folder created unless
    `create_folder` is False: a reader creates nothing)."""
    from akv_core.home import data_path, home_path

    env = os.environ.get("AKV_DB")
    if env:
        return env
    return f"sqlite:///{data_path(DEFAULT_DB_FILE) if create_folder else home_path() / DEFAULT_DB_FILE}"


def display_url(url: str) -> str:
    """`url` as it may be shown: without its password."""
    return make_url(url).render_as_string(hide_password=True)


def _parsed(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise StoreError(f"--db: cannot parse database URL {url!r} (expected sqlite:///FILE or postgresql://...)")


def normalize_url(url: str) -> str:
    """Check the URL's shape and pick the driver we support for it."""
    parsed = _parsed(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            folder = Path(database).expanduser().resolve().parent
            if not folder.is_dir():
                raise StoreError(f"--db: cannot open {url!r}: folder {folder} does not exist")
        return url
    if backend == "postgresql":
        if parsed.drivername == "postgresql":  # psycopg 3 rather than SQLAlchemy's psycopg2 default
            if importlib.util.find_spec("psycopg") is None:
                raise StoreError("--db: PostgreSQL needs the psycopg package (pip install 'akv[postgres]')")
            parsed = parsed.set(drivername="postgresql+psycopg")
        return parsed.render_as_string(hide_password=False)
    raise StoreError(f"--db: unsupported database {backend!r} in {url!r} (use sqlite or postgresql)")


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers (akv runs show) work while a run writes; busy_timeout rides out
    # the short write locks of optuna's storage sharing the same file.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def open_read_only(url: str) -> Engine | None:
    """An engine that reads `url` and can write nothing, or None where there is nothing to read: a
    SQLite file that does not exist (it is not created) or an in-memory database.

    SQLite opens the file read-only, and as immutable where no writer is mid-way (no `-wal` or
    `-journal` file beside it), so that reading creates no file beside it either and works where
    this user cannot write the file or its folder; otherwise the read-only connection follows
    SQLite's reader protocol on the files the writer keeps. PostgreSQL: every transaction is read-only.
    """
    parsed = _parsed(url)
    if parsed.get_backend_name() != "sqlite":
        return _engine(normalize_url(url), connect_args={"options": "-c default_transaction_read_only=on"})
    database = parsed.database or ""
    path = Path(database[len("file:"):] if database.startswith("file:") else database).expanduser()
    if database in ("", ":memory:") or not path.is_file():
        return None
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    if not any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal")):
        uri += "&immutable=1"
    return _engine("sqlite://", creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False))


def open_engine(url: str) -> Engine:
    """An engine for `url`; raises StoreError with a one-line message if it cannot be opened."""
    url = normalize_url(url)
    engine = _engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", err)).splitlines()[0]
        raise StoreError(f"--db: cannot open {make_url(url).render_as_string()}: {reason}") from None
    return engine


def _engine(url: str, **options: object) -> Engine:
    try:
        return create_engine(url, future=True, **options)
    except (ArgumentError, NoSuchModuleError) as err:
        raise StoreError(f"--db: cannot open {url!r}: {err}") from None
