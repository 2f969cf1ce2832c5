"""Recorded agent traffic as evaluation data: traces, their formats, use records and the trace suite.

A *trace* is one agent run as its requests showed it: the messages in order (any roles, user
turns in the middle, with or without a system prompt), the tool schemas when known, and per
recorded request (the history before each assistant message) the usage and latency when known.

- `model.py`: `Trace`, `TraceRequest` and their checks;
- `formats.py`: reading OpenAI chat JSON Lines, SWE-agent `.traj`, mini-swe-agent trajectories
  and this project's own recordings; text actions offered as tool calls;
- `runs.py`: `akv run` trajectories as traces (format akv-run);
- `records.py`: traces to and from the store's records;
- `suite.py`: a stored trace set as a suite, scored by fidelity (`docs/traces.md`).
"""
