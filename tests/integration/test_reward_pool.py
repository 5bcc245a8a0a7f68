"""The verifier pool on a real Ray: hostile inputs, hard timeouts, killed actors and processes.

Each hostile case is scored together with a control completion in the same call: the control
must still score 1, so a case that killed or hung the scorer process shows up as a pool that is
no longer healthy. (The wall-clock bound per case is measured by bench/hostile_inputs.py.)
"""
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import ray

from hostile_cases import BUILTIN, CUSTOM, CUSTOM_SEARCH_PATH, F_TESTS, GOOD_CODE, cases
from reward.pool import VerifierPool, summarize
from common.config import RewardConfig
from common.messages import ScoringRequest


TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


@pytest.fixture(scope="module")
def pools(ray_session):
    made = {
        "builtin": VerifierPool(RewardConfig(**BUILTIN, timeout_s=TIMEOUT_S, num_workers=1, num_cpus_per_worker=0.5)),
        "custom": VerifierPool(RewardConfig(**CUSTOM, timeout_s=TIMEOUT_S, num_workers=1, num_cpus_per_worker=0.5),
                               search_path=CUSTOM_SEARCH_PATH),
    }
    for pool in made.values():
        pool.ready()
    yield made
    for pool in made.values():
        pool.shutdown()


TAG = uuid.uuid4().hex[:12]
CASES = cases(port=0, tag=TAG)  # names and ids only; the real port is filled in per test


def test_at_least_25_hostile_cases():
    assert len(CASES) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_hostile_case_is_scored_and_the_pool_stays_healthy(index, pools, listening_port):
    case = cases(port=listening_port, tag=TAG)[index]
    control = case.control
    outcomes, stats = pools[case.pool].score_items(
        [ScoringRequest("prompt", case.completion, case.answer, case.fields), ScoringRequest("prompt", *control)])
    assert len(outcomes) == 2 and stats["completions"] == 2
    got, healthy = outcomes
    assert set(got.scores) == set(pools[case.pool].names)  # every verifier gave a score
    if case.score is not None:
        assert got.scores[case.verifier] == case.score
    if case.timeout is not None:
        assert (case.verifier in got.timed_out) == case.timeout
    assert (case.verifier in got.errors) == case.error
    assert healthy.scores[case.verifier] == 1.0 and not healthy.timed_out and not healthy.errors
    for path in case.absent:
        assert not os.path.exists(path), f"the sandbox wrote {path}"


def _sandbox_processes() -> set:
    """(pid, start time) of every process running as the sandbox's user, `nobody`."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == 65534:
                found.add((pid, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
    return found


def test_no_sandbox_process_outlives_its_call(pools):
    # After the fork bomb, the setsid escapee and the infinite loops: nothing left running as
    # the sandbox user (only checkable when the sandbox drops to `nobody`, i.e. as root).
    if os.getuid() != 0:
        pytest.skip("the sandbox runs as the caller's user: its processes are not told apart")
    # The other test worker's sandboxes (verifiers, python tool calls) may be running right now,
    # each ended by its own limits within seconds: only a process that is still there well after
    # any sandbox's limit (5 s here) outlived its call.
    left, deadline = _sandbox_processes(), time.monotonic() + 15.0
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left &= _sandbox_processes()
    assert not left


def test_timeouts_and_errors_are_counted_per_verifier(pools):
    pool = pools["custom"]
    items = [ScoringRequest("p", "HANG", "1", {}), ScoringRequest("p", "EXIT", "1", {}),
             ScoringRequest("p", "<answer>7</answer>", "1", {})]
    outcomes, stats = pool.score_items(items)
    metrics = summarize(stats, pool.names)
    assert metrics["reward_timeouts"] == 1 and metrics["reward_timeouts/hang"] == 1
    assert metrics["reward_errors"] == 1
    assert metrics["scorer_restarts"] == 1  # one kill for the hang; sys.exit is caught in-process
    assert metrics["pass/format"] == pytest.approx(1 / 3)
    # each of the first two loses format and its own verifier; the last passes all five
    assert [o.reward for o in outcomes] == [3.0, 3.0, 5.0]


def test_pool_scores_prompt_groups_by_reference_once_each(ray_session, pools):
    from common.prompt_group import PromptGroup

    def group(i, completions, fields):
        return PromptGroup(index=i, prompt=f"q{i}", answer="1", prompt_ids=[1], completions=completions,
                           completion_ids=[[1]] * len(completions), finish_reasons=["stop"] * len(completions),
                           policy_version=3, fields=fields)

    groups = [group(0, ["<think>a</think><answer>1</answer>", "<answer>2</answer>"], {}),
              group(1, [GOOD_CODE, "nothing"], {"tests": F_TESTS}),
              group(2, ["<think>b</think><answer>1</answer>"] * 3, {})]
    refs = [ray.put(g) for g in groups]
    scored_refs, stats = pools["builtin"].score(refs)
    assert all(isinstance(r, ray.ObjectRef) for r in scored_refs)
    scored = ray.get(scored_refs)
    assert [g.index for g in scored] == [0, 1, 2]
    assert stats["completions"] == 7
    assert scored[0].scores["math"] == [1.0, 0.0] and scored[0].scores["format"] == [1.0, 0.0]
    assert scored[1].scores["code"] == [1.0, 0.0]
    assert scored[0].rewards[0] == pytest.approx(1.0 + 0.1 + 0.1)  # math, format, language
    assert scored[2].timed_out == [[], [], []]
    assert stats["uniform_groups"] == 1  # group 2: three equal rewards


def test_actor_killed_mid_batch_is_restarted_and_its_batch_retried(ray_session):
    # Each program sleeps 1 s, so the kill lands while a chunk is being scored.
    settings = RewardConfig(verifiers=["code"], weights={"code": 1.0}, timeout_s=10.0, num_workers=2,
                            num_cpus_per_worker=0.5)
    pool = VerifierPool(settings)
    pool.ready()
    slow = "<answer>```python\nimport time\ntime.sleep(1)\ndef f():\n    return 1\n```</answer>"
    items = [ScoringRequest("p", slow, "", {"tests": F_TESTS}) for _ in range(8)]
    victim = pool.workers[0]
    first_pid = ray.get(victim.pid.remote())

    import threading

    killer = threading.Timer(1.5, lambda: ray.kill(victim, no_restart=False))
    killer.start()
    outcomes, stats = pool.score_items(items)
    killer.join()
    assert [o.scores["code"] for o in outcomes] == [1.0] * 8  # every completion, exactly one score
    assert stats["completions"] == 8  # the killed call's work counted once, by its re-run
    assert stats["actor_restarts"] == 1  # reported by the re-run on the restarted actor
    assert ray.get(victim.pid.remote()) != first_pid
    pool.shutdown()


def test_scorer_process_killed_from_outside_is_replaced_and_the_call_retried(ray_session):
    settings = RewardConfig(verifiers=["code"], weights={"code": 1.0}, timeout_s=10.0, num_workers=1,
                            num_cpus_per_worker=0.5)
    pool = VerifierPool(settings)
    pool.ready()
    worker = pool.workers[0]
    scorer_pid = ray.get(worker.scorer_pid.remote())
    slow = "<answer>```python\nimport time\ntime.sleep(1.5)\ndef f():\n    return 1\n```</answer>"
    import threading

    threading.Timer(0.7, lambda: os.kill(scorer_pid, 9)).start()
    outcomes, stats = pool.score_items([ScoringRequest("p", slow, "", {"tests": F_TESTS})])
    assert outcomes[0].scores == {"code": 1.0} and not outcomes[0].errors
    assert stats["scorer_restarts"] == 1
    assert ray.get(worker.scorer_pid.remote()) != scorer_pid
    pool.shutdown()
