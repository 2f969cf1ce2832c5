"""Errors a user can cause through the store; each carries a one-line message."""
from __future__ import annotations


class StoreError(Exception):
    """A store problem the user can fix (bad URL, unknown run, duplicate name)."""


class DuplicateRunName(StoreError):
    pass


class RunNotFound(StoreError):
    pass


class TraceSetNotFound(StoreError):
    pass


class TraceConflict(StoreError):
    """A trace whose id the set already holds with other content."""
