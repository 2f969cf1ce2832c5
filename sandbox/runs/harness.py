"""The harness: runs a task with an agent under a cache policy against a backend.

One step: the policy decides on the history (text mode: its edits are applied, the edited
history kept, and it decides again) -> the request goes to the backend with the full history
and the policy's drop / reposition fields -> the agent acts on what is visible -> its tool
calls run in the task's environment and their results join the history. The policy counts
tokens with the embedded model's chat tokenizer on every backend, so its decisions are the
same whichever backend serves the requests.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from akv_core.attribution import USED_MASS
from akv_core.cache.text_drop import TextDrop, remaining_text
from akv_core.chat import content_text
from policy_dsl.editor import TEXT_PASSES
from policy_dsl.reuse import ReuseFinder, used_indices

from sandbox.agents.llm import (DROP_CONTEXT, DROP_CONTEXT_TOOL, USE_RECORDS, AgentSetupError, LLMAgent,
                                 check_agent_mode)
from sandbox.backends import (Backend, BackendError, BackendReply, BackendRequest, Message, check_backend_spec,
                              open_backend)
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.cost import PriceTable, TokenTotals, ReportedUsage, price_table, table_names
from sandbox.runs.lanes import Lanes, TaskJob
from sandbox.runs.progress import TaskDisplay
from sandbox.runs.summarize import TextEditor
from sandbox.runs.trajectory import Exchange, Trajectory
from sandbox.suites import get_suite
from sandbox.suites.base import Agent, AgentAction, AgentView, Suite, Task, ToolError

STATUSES = ("ok", "gave_up", "max_steps", "error")
RESULT_FIELDS = ("task_id", "split", "policy", "status", "score", "answer", "n_requests", "tokens", "cost_usd",
                 "wall_s")


@dataclass(frozen=True)
class RunLimits:
    """Budgets of one task run."""

    max_steps: int = 100  # agent requests per task
    max_tokens: int = 256  # the llm agent's reply budget per step
    # A scripted agent ignores model text, so a generating backend writes one token only.
    scripted_max_tokens: int = 1
    text_passes: int = TEXT_PASSES  # text mode: edit-then-decide-again passes per step


@dataclass(frozen=True)
class TaskOutcome:
    """One task's outcome. `to_dict()` is the results format; `reason` explains an error.

    What the harness returns; `store.TaskResult` is what the store keeps of it (`evolve.scoring.from_harness`).
    """

    task_id: str
    split: str
    policy: str
    status: str
    score: float
    answer: str | None
    n_requests: int
    tokens: TokenTotals
    cost_usd: float
    wall_s: float
    reason: str | None = None
    # `--backend URL1,URL2,...`: each move of the task off a server that stopped answering.
    server_moves: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {"task_id": self.task_id, "split": self.split, "policy": self.policy, "status": self.status,
               "score": self.score, "answer": self.answer, "n_requests": self.n_requests,
               "tokens": self.tokens.to_dict(), "cost_usd": self.cost_usd, "wall_s": self.wall_s}
        if self.server_moves:
            out["server_moves"] = list(self.server_moves)
        return out


@dataclass(frozen=True)
class RunReport:
    results: list[TaskOutcome]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"results": [r.to_dict() for r in self.results], "summary": self.summary}


@dataclass
class _Bill:
    """Running totals of a task: every request, summaries included."""

    n_requests: int = 0
    tokens: TokenTotals = field(default_factory=TokenTotals)
    cost_usd: float = 0.0

    def add(self, usage: ReportedUsage, cost: float) -> None:
        self.n_requests += 1
        self.tokens = self.tokens.add(usage)
        self.cost_usd += cost


class _TaskRun:
    """One run of one task: owns the history, the environment's tool calls and the bill."""

    def __init__(self, task: Task, policy: Any, agent: Agent, backend: Backend, prices: PriceTable,
                 limits: RunLimits, seed: int, facts: Any = None, use_records: str = "references") -> None:
        self.task, self.policy, self.agent, self.backend = task, policy, agent, backend
        self.prices, self.limits, self.seed = prices, limits, seed
        self.counter = shared_tokenizer()
        self.is_llm = isinstance(agent, LLMAgent)
        # Where the llm agent's use records come from (USE_RECORDS); a scripted agent keeps its own.
        self.use_records = use_records if self.is_llm else "references"
        # The cache tool is offered only when the policy acts on it: a call that does nothing would mislead.
        self.offers_drop_context = getattr(agent, "uses_cache_tool", False) and reads_drop_context(policy)
        self.tools = (tuple(task.tools) + ((DROP_CONTEXT_TOOL,) if self.offers_drop_context else ())
                      + tuple(getattr(agent, "offered_tools", ())))  # the llm agent's final_answer in tools mode
        self.history: list[Message] = task.initial_messages()
        self.bill = _Bill()
        self.server: str | None = None  # the server of a pool that serves the task now
        self.moves: list[str] = []
        self.trajectory = Trajectory({"task_id": task.id, "suite": task.suite, "split": task.split,
                                      "policy": policy.name, "agent": agent.name, "backend": backend.name,
                                      "prices": prices.name,
                                      **({"use_records": self.use_records} if self.is_llm else {}),
                                      **({"group": task.meta["group"]} if task.meta.get("group") else {})})
        self.editor = TextEditor(task.prompt, backend, self.counter, self._bill_summary, facts)
        self.reuse_finder = ReuseFinder(tools=self.tools)
        self.final_message: Message | None = None  # the agent's answer as it wrote it (never sent)
        self._holders: tuple[tuple[int, ...], ...] | None = None  # the current step's copied strings' holders

    def run(self, env: Any) -> tuple[str, str | None]:
        """Steps until the agent answers or the step budget is spent: (status, answer)."""
        for step in range(self.task.max_steps or self.limits.max_steps):
            fields, messages = self._decide(step)
            request = BackendRequest(
                messages=tuple(messages), tools=self.tools,
                drop_message=fields.get("drop_message", {}), reposition=tuple(fields.get("reposition", ())),
                drop_rule=fields.get("drop_rule"),
                max_tokens=self.limits.max_tokens if self.is_llm else self.limits.scripted_max_tokens,
                seed=self.seed, tool_choice=self._tool_choice(step),
                attribution=self.use_records != "references",
            )
            reply = self.backend.complete(request)
            self._note_server(step, reply)
            view = agent_view(self.task, request, reply.message, step)
            action = self.agent.act(view)
            message = _with_call_ids(action.message, step)
            usage = reply.usage
            if not self.is_llm:  # a scripted agent wrote the message: bill it as the model's output
                usage = usage.with_completion(self.counter.count(message))
            self._holders = None
            used = self._use_record(env, view, action, message, reply)
            self._record(step, "agent", request, reply.message, usage, _checked_uses(used, request, view),
                         self._holders)
            self.history.append(message)
            responds = callable(getattr(env, "respond", None))
            if responds:  # a recorded run answers with what was recorded (it sees the final message too)
                self.history.extend(env.respond(view, message))
            if action.final_answer is not None:
                self.final_message = message
                return ("gave_up" if action.gave_up else "ok"), action.final_answer
            if not responds:
                self._run_tools(env, message)
        return "max_steps", None

    def _tool_choice(self, step: int) -> str | dict[str, Any] | None:
        """The agent's `tool_choice` for this step's request (the llm agent's tools mode), else None."""
        choose = getattr(self.agent, "tool_choice", None)
        return choose(step, self.tools) if callable(choose) else None

    def _use_record(self, env: Any, view: AgentView, action: AgentAction, message: Message,
                    reply: BackendReply) -> tuple[int, ...]:
        """A scripted agent's own record. For the llm agent, what its own checks read (`action.used`: the
        earlier calls a stuck model repeated) together with, by `use_records`, the messages its message
        reuses strings from (references), those the reply put at least USED_MASS of its attention on
        (attention; `akv_core.attribution`), or both. A step the backend gave no attribution for (a
        keep_text_drop request) takes the references, with a note in the trajectory."""
        if action.used is not None and not self.is_llm:
            return action.used
        found = set(action.used or ())
        attended = None
        if self.use_records != "references":
            attended = reply.attribution.used(USED_MASS) if reply.attribution is not None else None
            if attended is None:
                self.trajectory.note("no_attribution", step=view.step)
            found.update(attended or ())
        if self.use_records != "attention" or attended is None:
            found.update(self._inferred_uses(env, view, message))
        return tuple(sorted(found))

    def _inferred_uses(self, env: Any, view: AgentView, message: Message) -> tuple[int, ...]:
        """The use record of an agent that keeps none (the llm agent, a recorded run): for each
        distinctive string its message reuses, the latest visible message holding it
        (`policy_dsl/reuse.py`); the environment's finder where it has one (a trace set's)."""
        finder = getattr(env, "reuse_finder", None) or self.reuse_finder
        reuses = finder.reuses([*view.messages, message], len(view.messages))
        self._holders = tuple(r.holders for r in reuses)
        return used_indices(reuses, view.visible)

    def _note_server(self, step: int, reply: BackendReply) -> None:
        """Which server of a pool serves the task, and every move off one that stopped answering."""
        for move in reply.moves:
            self.trajectory.note("server_moved", step=step, from_url=move.from_url, to_url=move.to_url,
                                 reason=move.reason)
            self.moves.append(f"step {step}: {move.from_url} -> {move.to_url} ({move.reason})")
        if reply.server is not None and reply.server != self.server:
            if self.server is None:
                self.trajectory.note("server", step=step, url=reply.server)
            self.server = reply.server

    def _decide(self, step: int) -> tuple[dict[str, Any], Sequence[Message]]:
        """The policy's API fields for the current history and the messages to send (the history,
        or its kept text under cut rules); text mode edits the history first."""
        decision = self.policy.decide(self.history, self.counter)
        if self.policy.mode != "text":   # a policy object may offer api_fields() alone (the oracle's)
            kept = getattr(decision, "kept", None)
            return decision.api_fields(), decision.sent_messages(self.history) if kept else self.history
        for _ in range(self.limits.text_passes):
            if not decision.text_edits:
                break
            self.history = self.editor.apply(self.history, decision.text_edits, step)
            self.trajectory.note("text_edits", step=step, edits=[repr(e) for e in decision.text_edits],
                                 history_len=len(self.history))
            decision = self.policy.decide(self.history, self.counter)
        return decision.api_fields(), self.history

    def _run_tools(self, env: Any, message: Message) -> None:
        for call in message.get("tool_calls") or ():
            name, text = self._call_tool(env, call)
            self.history.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": text})

    def _call_tool(self, env: Any, call: Mapping[str, Any]) -> tuple[str, str]:
        """(tool name, result text); mistakes of the agent become the result text."""
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        raw = function.get("arguments")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else (raw or {})
        except json.JSONDecodeError as err:
            return name, f"error: the arguments of {name or 'the call'} are not valid JSON ({err.msg})"
        if not name:
            return name, "error: malformed tool call: expected a function name and JSON arguments"
        if not isinstance(arguments, dict):
            return name, f"error: the arguments of {name} must be a JSON object"
        if name == DROP_CONTEXT and self.offers_drop_context:
            # The cache policy reads drop_context calls from the history (model-based policies).
            ids = arguments.get("message_ids")
            return name, f"drop requested for messages {ids}; the cache policy applies it"
        try:
            return name, env.call_tool(name, arguments)
        except ToolError as err:
            self.trajectory.note("tool_error", tool=name, error=str(err))
            return name, f"error: {err}"

    def _record(self, step: int, purpose: str, request: BackendRequest, reply: Message | None,
                usage: ReportedUsage, used: tuple[int, ...] | None = None,
                holders: tuple[tuple[int, ...], ...] | None = None) -> None:
        cost = self.prices.cost(usage)
        self.bill.add(usage, cost)
        self.trajectory.add(Exchange(step, purpose, request, reply, usage, cost, used, holders))

    def _bill_summary(self, step: int, request: BackendRequest, reply: Message | None, usage: ReportedUsage) -> None:
        self._record(step, "summary", request, reply, usage)


def reads_drop_context(policy: Any) -> bool:
    """Whether a compiled policy acts on drop_context calls (a trigger or a selector that reads them)."""
    from policy_dsl import nodes

    return _contains(getattr(policy, "ast", None), (nodes.DropContextCalled, nodes.Requested))


def _contains(node: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(node, kinds):
        return True
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return any(_contains(getattr(node, f.name), kinds) for f in dataclasses.fields(node))
    if isinstance(node, (tuple, list)):
        return any(_contains(item, kinds) for item in node)
    return False


def _with_call_ids(message: Message, step: int) -> Message:
    """The message with an id on every tool call (its results must name it); unchanged when all have one."""
    calls = message.get("tool_calls") or ()
    if all(isinstance(c, Mapping) and c.get("id") for c in calls):
        return message
    fixed = [{**c, "id": c.get("id") or f"call_{step}_{n}"} if isinstance(c, Mapping) else
             {"id": f"call_{step}_{n}", "type": "function", "function": {}} for n, c in enumerate(calls)]
    return {**message, "tool_calls": fixed}


def agent_view(task: Task, request: BackendRequest, response: Message | None, step: int) -> AgentView:
    """What the agent may see after `request`: every drop it carries is in effect for the next message.

    A message dropped by `drop_message` or a `message_drop` rule is not visible; under
    `thinking_drop` the earlier assistant messages are shown without their reasoning; a
    `text_drop` shows messages without their cut text (a whole cut hides the message), and a
    `keep_text_drop` shows the kept messages the request sends.
    """
    operations = request.cache_operations()
    dropped = {int(index) for indices in (operations.drop_message or {}).values() for index in indices}
    messages: Sequence[Message] = request.messages
    if operations.thinking_drop:
        messages = tuple(_without_reasoning(m) for m in messages)
    if operations.text_drop is not None and operations.prompt is None:
        messages, dropped = _without_cut_text(messages, operations.text_drop)
    visible = tuple(i not in dropped for i in range(len(messages)))
    return AgentView(task, messages, visible, response, step, request.tools)


def _without_cut_text(messages: Sequence[Message], text_drop: TextDrop) -> tuple[tuple[Message, ...], set[int]]:
    """The messages with a text drop's cut characters taken out of their content, and the wholly cut ones."""
    shown, hidden = list(messages), set()
    for cut in text_drop.cuts:
        if cut.whole:
            hidden.add(cut.message)
        else:
            shown[cut.message] = {**shown[cut.message],
                                  "content": remaining_text(content_text(shown[cut.message]), cut.chars)}
    return tuple(shown), hidden


def _without_reasoning(message: Message) -> Message:
    if message.get("role") != "assistant" or "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}


def _checked_uses(used: Sequence[int] | None, request: BackendRequest, view: AgentView) -> tuple[int, ...] | None:
    """The agent's use record as stored: sorted unique indices of the request's visible messages.

    A record naming a message the policy hid claims the agent read what the model could not
    attend to: the hindsight oracle and every measure built on the records would be wrong, so
    the task fails instead.
    """
    if used is None:
        return None
    indices = tuple(sorted({int(i) for i in used}))
    if indices and not 0 <= indices[0] <= indices[-1] < len(request.messages):
        raise ValueError(f"AgentAction.used: indices must name messages 0..{len(request.messages) - 1} "
                         f"of the step's history, got {list(indices)}")
    hidden = [i for i in indices if not view.visible[i]]
    if hidden:
        raise ValueError(f"AgentAction.used at step {view.step}: message {hidden[0]} was hidden under the policy; "
                         f"an agent may use only the messages it can see")
    return indices


def run_task(task: Task, suite: Suite, policy: Any, agent: Agent, backend: Backend, *,
             prices: PriceTable | None = None, limits: RunLimits = RunLimits(),
             seed: int = 0, use_records: str = "references") -> tuple[TaskOutcome, Trajectory]:
    """Run one task to its result; every failure is caught here and reported in the result.

    `use_records`: where the llm agent's use records come from (USE_RECORDS; `check_use_records`)."""
    started = time.perf_counter()
    run = _TaskRun(task, policy, agent, backend, prices or price_table(), limits, seed,
                   getattr(suite, "summary_facts", None), use_records)  # facts: how the replay summarizer reads it
    status, answer, score, reason = "error", None, 0.0, None
    env = None
    try:
        backend.start_task()
        env = suite.open(task)
        status, answer = run.run(env)
        grade = env.grade(answer)
        score = grade.score
        run.trajectory.note("grade", score=grade.score, detail=grade.detail)
    except (BackendError, AgentSetupError) as err:
        reason = str(err)
    except Exception as err:  # noqa: BLE001 - a broken task must not lose the run; its reason is kept
        reason = f"{type(err).__name__}: {err}"
    finally:
        if env is not None:
            env.close()
    if reason is not None:
        status = "error"
    result = TaskOutcome(task.id, task.split, policy.name, status, float(score), answer, run.bill.n_requests,
                        run.bill.tokens, round(run.bill.cost_usd, 9), round(time.perf_counter() - started, 3),
                        reason, tuple(run.moves))
    run.trajectory.note("result", **result.to_dict(), reason=reason, final_message=run.final_message)
    return result, run.trajectory


def resolve_policy(policy: Any) -> Any:
    """A compiled policy from a built-in name, a file path, or a policy object (returned as is)."""
    if not isinstance(policy, (str, Path)):
        return policy
    from policy_dsl import load_policy
    from policy_dsl.errors import PolicyError

    try:
        return load_policy(str(policy))
    except PolicyError as err:  # unknown name, unreadable or invalid file: located, one line
        raise ValueError(str(err)) from err


def select_tasks(suite: Suite, split: str, task_ids: Sequence[str] | None = None,
                 limit: int | None = None) -> list[Task]:
    """The split's tasks, filtered to `task_ids` (in split order) and cut to `limit`."""
    tasks = suite.tasks(split)
    if task_ids is not None:
        known = {t.id for t in tasks}
        missing = [t for t in task_ids if t not in known]
        if missing:
            raise ValueError(f"unknown task id {missing[0]!r} in split {split!r}")
        wanted = set(task_ids)
        tasks = [t for t in tasks if t.id in wanted]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be a positive number of tasks, got {limit}")
        tasks = tasks[:limit]
    return tasks


def run_tasks(suite: str | Suite, split: str, policy: Any, agent: str = "scripted",
              backend: str | Backend = "replay", limit: int | None = None,
              task_ids: Sequence[str] | None = None, seed: int = 0, out_dir: Path | None = None,
              progress: Callable[[TaskOutcome], None] | None = None, *, model: str | None = None,
              prices: str | None = None, limits: RunLimits = RunLimits(), build: bool = True,
              on_start: Callable[[int], None] | None = None, concurrency: int = 1,
              lanes: Lanes | None = None, display: TaskDisplay | None = None,
              traced: Callable[[TaskOutcome, Trajectory | None], None] | None = None,
              precision: str | None = None, agent_mode: str = "tools",
              use_records: str = "references") -> RunReport:
    """Run a split's tasks; ValueError (one line, naming what was expected) for bad arguments.

    `concurrency` tasks run at once (`sandbox/runs/lanes.py`; `lanes` passes lanes kept open by the
    caller instead). Results come back, reach `progress` and are written in task order whatever
    order they finish in. With `out_dir`, each result is appended to `results.jsonl` and each
    trajectory written to `trajectories/<task>.jsonl`; without it nothing touches the disk.
    `display` hears of every task as it starts and as it finishes (`sandbox/runs/progress.py`).
    `traced` gets each result with its trajectory, in task order (None from process lanes).
    `precision` is the embedded backend's weight precision (`open_backend`), when `backend` is a name.
    `agent_mode` is the llm agent's (`sandbox/agents/llm.py`: tools or free); `use_records` where its use
    records come from (`USE_RECORDS`; attention needs a backend with attribution, `check_use_records`).
    """
    suite_obj = get_suite(suite) if isinstance(suite, str) else suite
    policy_obj = resolve_policy(policy)
    if agent not in ("scripted", "llm"):
        raise ValueError(f"unknown agent {agent!r}: expected scripted or llm")
    check_agent_mode(agent_mode)
    table = price_table(prices or (model if model and model.lower() in table_names() else None))
    if build:
        from akv_core.home import akv_home

        suite_obj.build(akv_home(), seed)
    tasks = select_tasks(suite_obj, split, task_ids, limit)
    if isinstance(backend, str):
        check_backend_spec(backend, concurrency)  # before a model loads or a server is asked
    if isinstance(backend, str) and display is not None and backend == "embedded":
        display.phase(f"loading the model {model or 'smollm2'} (embedded backend)")
    backend_obj = lanes.backend if lanes is not None else (
        open_backend(backend, model, precision) if isinstance(backend, str) else backend)
    own_lanes = lanes is None
    try:
        if agent == "llm" and not backend_obj.generates:
            raise ValueError("the llm agent needs a model: use --backend embedded or an endpoint URL "
                             "(replay has no model)")
        check_use_records(use_records, backend_obj, agent)
        if own_lanes:
            lanes = Lanes(backend_obj, concurrency)
        if on_start is not None:
            on_start(len(tasks))
        if display is not None:
            display.begin(len(tasks), f"{policy_obj.name} on {suite_obj.name}/{split}")
        started = time.perf_counter()
        jobs = [TaskJob(task, policy_obj, agent, seed, limits, table, out_dir, agent_mode, use_records)
                for task in tasks]
        results: list[TaskOutcome] = []
        heard = (display.started, display.finished) if display is not None else (None, None)
        for result, trajectory in lanes.run_jobs(jobs, suite_obj, run_job, *heard):
            results.append(result)
            if out_dir is not None:
                _append_result(out_dir, result)
            if progress is not None:
                progress(result)
            if traced is not None:
                traced(result, trajectory)
    finally:
        if own_lanes and lanes is not None:
            lanes.close()
        if own_lanes and isinstance(backend, str):
            backend_obj.close()
    summary = summarize_results(results, suite=suite_obj.name, split=split, policy=policy_obj.name,
                                agent=agent, backend=backend_obj.name, prices=table.name,
                                wall_s=time.perf_counter() - started, out_dir=out_dir)
    return RunReport(results, summary)


def check_use_records(use_records: str, backend: Backend, agent: str = "llm") -> None:
    """ValueError (one line) unless `agent` on `backend` can have the use records `use_records` asks for."""
    if use_records not in USE_RECORDS:
        raise ValueError(f"use_records: expected {', '.join(USE_RECORDS)}, got {use_records!r}")
    if use_records != "references" and agent != "llm":
        raise ValueError(f"use_records: {use_records!r} is for the llm agent; the {agent} agent keeps its own "
                         "records")
    if use_records == "references":
        return
    if not getattr(backend, "attributes", False):
        raise ValueError(f"use_records: {use_records!r} needs a backend with attribution (the model's attention "
                         f"mass per message); the {backend.name} backend has none: use references")
    lacks = getattr(backend, "lacks", None)   # a server says in its model card whether it computes attribution
    missing = lacks("return_attribution") if callable(lacks) else None
    if missing is not None:
        raise ValueError(f"use_records: {use_records!r} needs a backend with attribution (the model's attention "
                         f"mass per message, `return_attribution`); {missing}: use references")


def run_job(job: TaskJob, suite: Suite, backend: Backend) -> tuple[TaskOutcome, Trajectory]:
    """One job of a lane: its agent, its run, its trajectory written under the job's out_dir."""
    task_agent = LLMAgent(job.agent_mode) if job.agent == "llm" else suite.scripted_agent(job.task)
    result, trajectory = run_task(job.task, suite, job.policy, task_agent, backend, prices=job.prices,
                                  limits=job.limits, seed=job.seed, use_records=job.use_records)
    if job.out_dir is not None:
        trajectory.write(job.out_dir / "trajectories" / f"{_file_safe(result.task_id)}.jsonl")
    return result, trajectory


def _append_result(out_dir: Path, result: TaskOutcome) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "results.jsonl").open("a", encoding="utf-8") as out:
        out.write(json.dumps(result.to_dict()) + "\n")


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def summarize_results(results: Sequence[TaskOutcome], *, wall_s: float, out_dir: Path | None = None,
                      **run: Any) -> dict[str, Any]:
    """Run-level figures: mean score and cost, total tokens, statuses, and every error's reason."""
    n = len(results)
    tokens = sum((r.tokens for r in results), TokenTotals())
    statuses = {s: sum(r.status == s for r in results) for s in STATUSES}
    return {
        **run,
        "n_tasks": n,
        "statuses": statuses,
        "mean_score": round(sum(r.score for r in results) / n, 6) if n else 0.0,
        "mean_cost_usd": round(sum(r.cost_usd for r in results) / n, 9) if n else 0.0,
        "total_cost_usd": round(sum(r.cost_usd for r in results), 9),
        "n_requests": sum(r.n_requests for r in results),
        "tokens": tokens.to_dict(),
        "errors": {r.task_id: r.reason for r in results if r.status == "error"},
        "wall_s": round(wall_s, 3),
        "out_dir": str(out_dir) if out_dir is not None else None,
    }
