"""The agents' process pool (rollout/agents.py) with real processes: an episode's time limit
starts when its process is ready, not when the task is handed over, so a pool that is slow to
start fails nothing; an agent that hangs is still killed at its limit; a process that never
becomes ready fails its task and is replaced; an agent that closes its client does not break the
next episode's; an `async def` agent's episodes share processes, one that awaits past its limit
is cancelled alone, and one that blocks the event loop has its process stopped."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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

CLOSING = '''
def closing(client, row, index):
    with client:  # closes the client, and with it the HTTP connection pool it was given
        return client.models.list().data[0].id


async def closing_async(client, row, index):
    async with client:
        return (await client.models.list()).data[0].id
'''


SHARED = '''
import asyncio
import os
import time


async def overlapping(client, row, index):
    start = time.monotonic()
    await asyncio.sleep(0.3)
    return f"{os.getpid()} {start} {time.monotonic()}"


async def waits_forever(client, row, index):
    if index == 0:
        await asyncio.sleep(60)
    return f"{os.getpid()}"


async def blocks(client, row, index):
    time.sleep(60)  # never awaits: the event loop is stuck


def plain(client, row, index):
    return f"{os.getpid()}"
'''


class _Models(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": self.path.split("/")[1], "object": "model",
                                                       "created": 0, "owned_by": "test"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


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
        (result,) = _run(pool, _tasks(1)).values()
        assert result.timed_out and result.answer is None and "timed out" in result.error
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


def test_an_agent_that_closes_its_client_leaves_the_next_episode_a_working_one(tmp_path):
    (tmp_path / "closing_agents.py").write_text(CLOSING)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("closing", "closing_async"):
            pool = AgentPool(f"closing_agents:{name}", 1, 30.0, search_path=[str(tmp_path)])
            tasks = [AgentTask(i, f"http://127.0.0.1:{server.server_port}/s{i}/v1", "key", {}, i) for i in range(3)]
            try:
                results = _run(pool, tasks)  # one process: the three episodes one after another
            finally:
                pool.close()
            assert {i: (r.answer, r.error) for i, r in results.items()} == {i: (f"s{i}", None) for i in range(3)}, name
    finally:
        server.shutdown()


def _shared_pool(tmp_path, name: str, size: int, per_process: int) -> AgentPool:
    (tmp_path / "shared_agents.py").write_text(SHARED)
    return AgentPool(f"shared_agents:{name}", size, LIMIT_S, search_path=[str(tmp_path)], per_process=per_process)


def test_async_episodes_share_a_process_and_run_at_once(tmp_path):
    pool = _shared_pool(tmp_path, "overlapping", 4, 4)
    try:
        results = _run(pool, _tasks(8))
        assert len(pool._procs) == 1 and pool.capacity == 4
    finally:
        pool.close()
    assert all(r.error is None for r in results.values()), results
    spans = [tuple(float(x) for x in r.answer.split()[1:]) for r in results.values()]
    assert len({r.answer.split()[0] for r in results.values()}) == 1
    assert any(a[0] < b[0] < a[1] for a in spans for b in spans if a != b)  # some ran at the same time


def test_an_async_episode_past_its_limit_is_cancelled_alone(tmp_path):
    pool = _shared_pool(tmp_path, "waits_forever", 2, 2)
    try:
        results = _run(pool, _tasks(2))
        alive = pool._procs[0][0].pid
    finally:
        pool.close()
    assert results[0].timed_out and results[0].answer is None
    assert results[1].error is None and results[1].answer == str(alive)  # the same process, not replaced


def test_an_async_agent_that_blocks_its_event_loop_has_its_process_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout.agents.ASYNC_GRACE_S", 0.2)
    pool = _shared_pool(tmp_path, "blocks", 2, 2)
    try:
        pool.submit(_tasks(2))
        first = pool._procs[0][0].pid
        results = {}
        while pool.pending:
            results.update((r.task_id, r) for r in pool.poll(0.2))
        assert pool._procs[0][0].pid != first and pool._procs[0][0].is_alive()  # a new process in its slot
    finally:
        pool.close()
    assert len(results) == 2 and all(r.answer is None for r in results.values())
    assert any(r.timed_out for r in results.values())


def test_a_def_agent_gets_a_process_per_episode_whatever_the_sharing(tmp_path):
    pool = _shared_pool(tmp_path, "plain", 2, 4)
    try:
        results = _run(pool, _tasks(4))
        assert pool.capacity == 1 and len(pool._procs) == 2
    finally:
        pool.close()
    assert all(r.error is None for r in results.values())
    assert os.getpid() not in {int(r.answer) for r in results.values()}


def test_no_more_async_episodes_at_once_than_the_pool_size(tmp_path):
    pool = _shared_pool(tmp_path, "overlapping", 3, 8)
    try:
        pool.submit(_tasks(7))
        most = 0
        results = {}
        while pool.pending:
            most = max(most, sum(len(tasks) for tasks in pool._busy.values()))
            results.update((r.task_id, r) for r in pool.poll(0.05))
        assert len(pool._procs) == 1 and pool.capacity == 3
    finally:
        pool.close()
    assert most == 3 and len(results) == 7 and all(r.error is None for r in results.values())


def test_a_process_that_died_while_idle_is_replaced_when_work_comes(tmp_path):
    pool = _shared_pool(tmp_path, "plain", 1, 1)
    try:
        first = _run(pool, _tasks(1))[0]
        proc = pool._procs[0][0]
        proc.kill()
        proc.join()
        (result,) = _run(pool, _tasks(1)).values()
    finally:
        pool.close()
    assert first.error is None and result.error is None and result.answer != first.answer
