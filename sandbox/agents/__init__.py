"""Agents that are not tied to a suite. Suites ship their own scripted agents."""
