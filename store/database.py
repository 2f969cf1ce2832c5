"""Opening a database by URL: SQLite (WAL) in the data folder by default, PostgreSQL by URL."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

from store.errors import StoreError

DEFAULT_DB_FILE = "akv.db"


def default_url() -> str:
    """`AKV_DB` if set, else the SQLite file in the data folder."""
    from akv_core.home import data_path

    env = os.environ.get("AKV_DB")
    if env:
        return env
    return f"sqlite:///{data_path(DEFAULT_DB_FILE)}"


def normalize_url(url: str) -> str:
    """Check the URL's shape and pick the driver we support for it."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(f"--db: cannot parse database URL {url!r} (expected sqlite:///FILE or postgresql://...)")
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


def open_engine(url: str) -> Engine:
    """An engine for `url`; raises StoreError with a one-line message if it cannot be opened."""
    url = normalize_url(url)
    try:
        engine = create_engine(url, future=True)
    except (ArgumentError, NoSuchModuleError) as err:
        raise StoreError(f"--db: cannot open {url!r}: {err}") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", err)).splitlines()[0]
        raise StoreError(f"--db: cannot open {make_url(url).render_as_string()}: {reason}") from None
    return engine
