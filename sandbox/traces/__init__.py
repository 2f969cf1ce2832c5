"""Recorded agent traffic as evaluation data: traces, their formats, use records and the trace suite.

A *trace* is one agent run as its requests showed it: the messages in order (any roles, user
turns in the middle, with or without a system prompt), the tool schemas when known, and per
recorded request (the history before each assistant message) the usage and latency when known.

- `model.py`: `Trace`, `TraceRequest` and their checks;
- `formats.py`: the formats, which reader reads a file (detection), the checks every trace passes;
- `readers/`: one module per source of files (OpenAI chat logs and message lists, SWE-agent,
  mini-swe-agent, tau-bench, OpenHands, Anthropic Messages logs, Claude Code sessions, the Agent
  Data Protocol, OpenTelemetry GenAI spans, this project's own exports), each saying what it reads
  and drops;
- `actions.py`: agents that act in text, told apart and offered in tool-call form;
- `runs.py`: `akv run` trajectories as traces (format akv-run);
- `importing.py`: `akv traces import`, one file at a time, ids that never collide by accident;
- `reading.py`: what the readers share with the recording: a file's JSON, OpenAI's keys, `extends`;
- `recording.py`: `akv proxy --record`, the proxy's answered requests as a trace set (format akv-proxy);
- `records.py`: traces to and from the store's records;
- `suite.py`: a stored trace set as a suite, scored by fidelity (`docs/traces.md`);
- `likelihood.py`: the likelihood fidelity, the recorded replies scored by a model under a policy
  against `full` (`validation.fidelity: likelihood`).
"""
