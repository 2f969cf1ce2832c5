"""Agents that are not tied to a suite. Suites ship their own scripted agents."""
from __future__ import annotations

AGENT_KINDS = ("scripted", "llm")
