"""The agents' process pool (rollout/agents.py) with real processes: an episode's time limit
starts when its process is ready, not when the task is handed over, so a pool that is slow to
start fails nothing; an agent that hangs is still killed at its limit; a process that never
becomes ready fails its task and is replaced."""
from __future__ import annotations

import time

from rollout.agents import AgentPool, AgentTask

IMPORT_S = 2.0  # the agent module's own import time, longer than the time limit below
LIMIT_S = 1.0

AGENT = f'''
import time

time.sleep({IMPORT_S})


def quick(client, row, index):
    return f"{{row['q']}} {{index}}"


def hang(client, row, index):
    time.sleep(60)
'''


def _run(pool: AgentPool, tasks) -> dict:
    pool.submit(tasks)
    results = {}
    while pool.pending:
        for result in pool.poll(0.2):
            results[result.task_id] = result
    return results


def _tasks(n: int):
    return [AgentTask(i, "http://127.0.0.1:9/v1", "key", {"q": "x"}, i) for i in range(n)]


def test_a_slow_start_does_not_count_against_the_time_limit_but_a_hang_does(tmp_path):
    (tmp_path / "slow_agents.py").write_text(AGENT)
    pool = AgentPool("slow_agents:quick", 2, LIMIT_S, search_path=[str(tmp_path)])
    try:
        results = _run(pool, _tasks(4))
        assert {i: (r.answer, r.error) for i, r in results.items()} == {i: (f"x {i}", None) for i in range(4)}
    finally:
        pool.close()
    pool = AgentPool("slow_agents:hang", 1, LIMIT_S, search_path=[str(tmp_path)])
    try:
        started = time.monotonic()
        (result,) = _run(pool, _tasks(1)).values()
        assert result.timed_out and result.answer is None and "timed out" in result.error
        assert time.monotonic() - started >= IMPORT_S + LIMIT_S  # the limit ran from readiness
    finally:
        pool.close()


def test_a_process_that_never_gets_ready_fails_its_task_and_is_replaced(tmp_path):
    (tmp_path / "slow_agents.py").write_text(AGENT)
    pool = AgentPool("slow_agents:quick", 1, LIMIT_S, search_path=[str(tmp_path)])
    pool.start_limit_s = 0.5
    try:
        (result,) = _run(pool, _tasks(1)).values()
        assert not result.timed_out and "did not start within 0.5 s" in result.error
        assert len(pool._procs) == 1 and pool._procs[0][0].is_alive()  # a new process in its slot
    finally:
        pool.close()
