"""tau-bench results (`tau-bench`): one JSON array of runs, as `run.py` writes its results and as
`historical_trajectories/*.json` hold them.

Read, per run: `traj`, the agent's chat history with OpenAI keys (system policy, the simulated
user's turns, assistant messages with tool calls, tool results), one request per assistant
message; `task_id`, `trial` and `reward` as the metadata's task, trial and reward (agent
"tau-bench"). The id is `<file stem>-task-<task_id>-trial-<trial>` (the stem names the
environment and model of a results file, so two files' runs of one task do not collide), and a
second run with the same task and trial in one file is refused. The line is the line where the
run starts in the file.

Dropped: `info` (the task's instruction to the simulated user, the expected actions, the
reward's breakdown, the user simulator's cost) and any other key of a run.
"""
from __future__ import annotations

from typing import Mapping

from sandbox.traces.model import Trace, TraceError
from sandbox.traces.reading import Source, dig, file_provenance, file_stem, openai_message

FORMAT = "tau-bench"


def claims(source: Source) -> bool:
    """A JSON array whose first element is a run: an object with `task_id` and a `traj` list."""
    doc = source.document
    return source.whole and isinstance(doc, list) and bool(doc) and isinstance(dig(doc[0], "traj"), list) \
        and "task_id" in doc[0]


def read(source: Source) -> list[tuple[int, Trace]]:
    stem, located, seen = file_stem(source.path), [], {}
    for index, (line, run) in enumerate(source.items()):
        where = f"{source.path}:{line}"
        if not isinstance(run, Mapping) or not isinstance(run.get("traj"), list) or "task_id" not in run:
            raise TraceError(f'{where}: run {index} is not a tau-bench run: expected an object with "task_id" and '
                             'a "traj" list of messages')
        task, trial = run["task_id"], run.get("trial")
        trace_id = f"{stem}-task-{task}" + (f"-trial-{trial}" if trial is not None else "")
        if trace_id in seen:
            raise TraceError(f"{where}: run {index} repeats task {task!r}, trial {trial!r} of the run at line "
                             f"{seen[trace_id]}: expected one run per task and trial")
        seen[trace_id] = line
        metadata = {key: value for key, value in (("task", task), ("trial", trial), ("reward", run.get("reward")),
                                                  ("agent", "tau-bench")) if value is not None}
        messages = tuple(openai_message(m) for m in run["traj"])
        provenance = {**file_provenance(FORMAT, source.path), "line": line, "run": index}
        located.append((line, Trace(trace_id, messages, provenance=provenance, metadata=metadata)))
    return located
