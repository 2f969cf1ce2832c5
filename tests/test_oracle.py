"""The hindsight oracle: its schedule from recorded use records, run as a policy in the real harness."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.runs.oracle import PROTECTED, AgentStep, HindsightOracle, OracleError, drop_schedule
from sandbox.runs.trajectory import step_ranges
from sandbox.suites import get_suite
from sandbox.suites.base import AgentAction, AgentView
from test_sandbox_support import Reader


@pytest.fixture(scope="module")
def localcomp():
    from akv_core.home import akv_home

    suite = get_suite("localcomp")
    suite.build(akv_home(), 0)
    return suite


class _Recalling(Reader):
    """Reads documents one per step, each step reading the result before; its answer reads the first one."""

    def act(self, view: AgentView) -> AgentAction:
        action = super().act(view)
        latest = len(view.messages) - 1
        used = (3, latest) if action.final_answer is not None else ((latest,) if view.step else ())
        return AgentAction(action.message, action.final_answer, used=used)


def _steps(trajectory) -> list[AgentStep]:
    return [AgentStep(e.request.messages, e.used) for e in trajectory.exchanges if e.purpose == "agent"]


def test_each_message_goes_right_after_its_last_use(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    _, trajectory = run_task(task, localcomp, resolve_policy("full"), _Recalling(5), ReplayBackend())
    steps = _steps(trajectory)
    schedule = drop_schedule(steps)
    last = len(steps) - 1
    for index, trigger in schedule.items():
        uses = [n for n, step in enumerate(steps) if index in step.used]
        first_seen = min(n for n, step in enumerate(steps) if index < len(step.messages))
        at = max(uses, default=first_seen)
        assert trigger == len(steps[at].messages) > index  # the message that step wrote
        assert at < last
    used_at_the_end = set(steps[last].used)
    assert 3 in used_at_the_end and 3 not in schedule  # the first document is read by the answer
    assert not set(PROTECTED) & set(schedule)
    # every message seen before the last step goes, except what the last step reads
    assert set(schedule) == set(range(2, len(steps[last - 1].messages))) - used_at_the_end


def test_the_oracle_replays_the_full_run_cheaper_with_the_same_actions_and_score(localcomp, tmp_path: Path) -> None:
    task = localcomp.tasks("train")[0]
    full, recorded = run_task(task, localcomp, resolve_policy("full"), _Recalling(6), ReplayBackend())
    recorded.write(tmp_path / "full.jsonl")
    oracle = HindsightOracle.from_file(tmp_path / "full.jsonl")
    assert oracle.schedule == HindsightOracle.from_trajectory(recorded).schedule
    result, replayed = run_task(task, localcomp, oracle, _Recalling(6), ReplayBackend())
    assert result.status == full.status == "ok" and result.score == full.score and result.answer == full.answer
    assert replayed.exchanges[-1].request.messages == recorded.exchanges[-1].request.messages
    assert result.cost_usd < full.cost_usd and result.tokens.drop_skipped > 0
    fields = replayed.exchanges[-1].request.api_fields()
    assert fields["reposition"] == sorted(int(t) for t in fields["drop_message"])


class _Forgetful(Reader):
    """Never records reading the first document, yet fetches it again when it is gone: the run diverges."""

    def act(self, view: AgentView) -> AgentAction:
        action = super().act(view)
        if view.step == 2 and not view.visible[3]:
            call = {"id": "again", "type": "function",
                    "function": {"name": "get_document", "arguments": json.dumps({"docid": "lc-00001"})}}
            action = AgentAction({"role": "assistant", "content": "", "tool_calls": [call]})
        return AgentAction(action.message, action.final_answer, used=(len(view.messages) - 1,))


def test_a_run_that_leaves_the_recorded_trajectory_is_an_error_naming_the_message(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    _, recorded = run_task(task, localcomp, resolve_policy("full"), _Forgetful(5), ReplayBackend())
    result, _ = run_task(task, localcomp, HindsightOracle.from_trajectory(recorded), _Forgetful(5), ReplayBackend())
    assert result.status == "error" and "left the recorded trajectory at message 6" in result.reason


def test_a_trajectory_without_use_records_names_them_and_the_command_that_regenerates_them(
        localcomp, tmp_path: Path) -> None:
    task = localcomp.tasks("train")[0]
    _, recorded = run_task(task, localcomp, resolve_policy("full"), _Recalling(4), ReplayBackend())
    path = tmp_path / "old.jsonl"
    recorded.write(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    older = [{k: v for k, v in record.items() if k != "used"} for record in lines]  # as runs wrote them before
    path.write_text("".join(json.dumps(record) + "\n" for record in older))
    with pytest.raises(OracleError) as caught:
        HindsightOracle.from_file(path)
    message = str(caught.value)
    assert str(path) in message and '"used"' in message and "steps 0-4 of 5" in message
    assert f"akv run --suite localcomp --split train --policy full --agent scripted --task {task.id}" in message


def test_a_trajectory_under_another_policy_is_refused(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    _, recorded = run_task(task, localcomp, resolve_policy("expert-8k"), _Recalling(3), ReplayBackend())
    with pytest.raises(OracleError, match="recorded under policy 'expert-8k'.*'full'"):
        HindsightOracle.from_trajectory(recorded)


def test_on_localcomp_tasks_the_oracle_of_the_scripted_agent_keeps_its_actions_and_undercuts_the_expert(
        localcomp, tmp_path: Path) -> None:
    from sandbox.runs.harness import run_tasks
    from sandbox.runs.oracle import run_oracle

    report = run_tasks(localcomp, "train", "full", limit=2, out_dir=tmp_path)
    for full in report.results:
        task = next(t for t in localcomp.tasks("train") if t.id == full.task_id)
        oracle = HindsightOracle.from_file(tmp_path / "trajectories" / f"{task.id}.jsonl")
        result, _ = run_task(task, localcomp, oracle, localcomp.scripted_agent(task), ReplayBackend())
        expert, _ = run_task(task, localcomp, resolve_policy("expert-8k"), localcomp.scripted_agent(task),
                             ReplayBackend())
        assert (result.status, result.score, result.answer) == (full.status, full.score, full.answer)
        assert result.cost_usd < min(full.cost_usd, expert.cost_usd) and result.score >= expert.score
        again = run_oracle(task, localcomp, ReplayBackend)  # in memory: the same schedule, the same run
        assert again.same_actions and again.oracle.cost_usd == result.cost_usd


@pytest.mark.slow
def test_on_a_localswe_task_the_oracle_of_the_scripted_agent_scores_as_full_for_less(tmp_path_factory) -> None:
    # slow: the task's own tests run in the sandbox under `full` and under the oracle (its first 8 steps)
    from sandbox.runs.harness import RunLimits
    from sandbox.runs.oracle import run_oracle
    from sandbox.suites.localswe import LocalSWE
    from test_localswe_suite import built_home

    suite = LocalSWE(hosts=["isodate"], bugs_per_host=3, max_tries=12)  # the session's small build
    suite.build(built_home(tmp_path_factory), seed=0)
    task = suite.tasks("train")[0]
    run = run_oracle(task, suite, ReplayBackend, limits=RunLimits(max_steps=8))
    assert run.same_actions and run.full.status == run.oracle.status
    assert run.oracle.score == run.full.score and run.oracle.cost_usd < run.full.cost_usd
    assert run.oracle.tokens.drop_skipped > 0


def test_step_ranges_joins_each_run_of_consecutive_steps() -> None:
    assert step_ranges([0, 1, 2, 3, 5]) == "0-3, 5" and step_ranges([3, 4, 5, 9], ",") == "3-5,9"
    assert step_ranges([7]) == "7" and step_ranges([]) == ""
