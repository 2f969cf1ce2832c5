"""The one data folder for everything generated at set-up or run time.

Task corpora, fetched code bases, databases and reports all live under
`AKV_HOME` (default: `.akv/` in the working directory).
"""
from __future__ import annotations

import os
from pathlib import Path


def home_path() -> Path:
    """The data folder's path, not created (for lookups that must write nothing)."""
    return Path(os.environ.get("AKV_HOME", ".akv")).expanduser()


def akv_home() -> Path:
    """Return the data folder, creating it if needed."""
    home = home_path()
    home.mkdir(parents=True, exist_ok=True)
    return home


def data_path(*parts: str) -> Path:
    """A path inside the data folder; parent folders are created."""
    path = akv_home().joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
