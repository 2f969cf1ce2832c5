"""store: runs, policies with their lineage, evaluations and validations in SQL.

SQLite (WAL) in the data folder by default, PostgreSQL by URL; the schema is versioned
(see `migrations`). Everything leaving the store is a frozen record.
"""
from store.errors import DuplicateRunName, RunNotFound, StoreError
from store.live import LiveChanged, LivePolicies, NoSuchEntry
from store.records import (ConversationCost, EvaluationRecord, LiveEntry, PolicyInfo, PolicyTotals, Proposal,
                           RoundInfo, RunInfo, TaskResult, TimelineRecord, ValidationRecord, ValidationRound)
from store.repository import Store
from store.work import BatchCounts, Lease, WorkerInfo, WorkQueue

__all__ = [
    "Store", "StoreError", "DuplicateRunName", "RunNotFound", "RunInfo", "PolicyInfo", "Proposal",
    "TaskResult", "TimelineRecord", "EvaluationRecord", "ValidationRecord", "ValidationRound", "WorkQueue", "Lease",
    "WorkerInfo", "BatchCounts", "LivePolicies", "LiveChanged", "NoSuchEntry", "LiveEntry", "RoundInfo",
    "ConversationCost", "PolicyTotals",
]
