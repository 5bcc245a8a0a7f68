"""`generate` with an agent: one session per sample, the agents in their processes, the engine
stepping every session's requests together until every agent has returned."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from common.messages import ChunkReport, GenerationRequest
from common.prompt_group import PromptGroup
from rollout.agents import AgentResult, AgentTask
from rollout.sessions import Session
from common.seeds import sample_seed

_IDLE_WAIT_S = 0.005


def run_agents(worker, requests: Sequence[GenerationRequest], n: int, greedy: bool,
               seeds: Sequence[Optional[int]], temperature, version: int) -> Tuple[Any, ...]:
    """n agent sessions per prompt; returns the groups, then a ChunkReport (as `generate` does)."""
    c = worker.cfg
    sessions: List[Session] = []
    tasks: List[AgentTask] = []
    session_seeds: Dict[str, int] = {}
    for request, seed in zip(requests, seeds):
        for j in range(n):
            session = worker.sessions.open(c.completion_budget)
            if not greedy and seed is not None:  # None: unseeded sampling (rollout.seeded_sampling)
                session_seeds[session.id] = sample_seed(seed, j)
            row = {**request.fields, "prompt": request.prompt, "answer": request.answer}
            tasks.append(AgentTask(len(sessions), worker.endpoint.base_url(session), session.key, row, j))
            sessions.append(session)
    worker._agent_call = {"seeds": session_seeds, "greedy": greedy, "temperature": temperature}
    before = dict(worker.endpoint.stats)
    results = _drive(worker, tasks)
    worker._agent_call = {}
    for session in sessions:
        worker.sessions.close(session.id)
    groups = [_group(request, sessions[k * n:(k + 1) * n], results[k * n:(k + 1) * n], worker, greedy, version)
              for k, request in enumerate(requests)]
    stats: Dict[str, float] = {
        "completions": float(len(sessions)),
        # As the built-in episode loop counts them: sampled and observation tokens together.
        "completion_tokens": float(sum(len(s.ids) for s in sessions)),
        "observation_tokens": float(sum(s.observation_tokens for s in sessions)),
        "turns": float(sum(s.turns for s in sessions)),
        "tool_calls": float(sum(s.tool_calls for s in sessions)),
        "agent_errors": float(sum(r.error is not None and not r.timed_out for r in results)),
        "agent_timeouts": float(sum(r.timed_out for r in results)),
        "template_drift": float(sum(s.drift_turns for s in sessions)),
        **{k: float(v - before.get(k, 0)) for k, v in worker.endpoint.stats.items()},
    }
    records: Dict[str, Any] = {}
    error = next((r.error for r in results if r.error is not None), None)
    if error is not None:
        records["first_agent_error"] = error
    drift = next((s.drift for s in sessions if s.drift is not None), None)
    if drift is not None:
        decode = lambda ids: worker.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        records["first_drift"] = {"turn": drift.turn, "position": drift.position, "stored": drift.stored,
                                  "rendered": drift.rendered, "stored_text": decode(drift.stored),
                                  "rendered_text": decode(drift.rendered)}
    return (*groups, ChunkReport(stats, versions=(version,) * len(groups), records=records))


def _drive(worker, tasks: List[AgentTask]) -> List[AgentResult]:
    """Step the engine for the endpoint's requests until every agent has returned."""
    pool, bridge, engine = worker.agents, worker.bridge, worker.engine
    results: Dict[int, AgentResult] = {}
    pool.submit(tasks)
    try:
        while pool.pending:
            bridge.pump(engine, wait_s=_IDLE_WAIT_S)
            for result in pool.poll(0.0):
                results[result.task_id] = result
    except BaseException:
        bridge.fail_all("the worker stopped this call")
        raise
    return [results[t.task_id] for t in tasks]


def _group(request: GenerationRequest, sessions: List[Session], results: List[AgentResult], worker,
           greedy: bool, version: int) -> PromptGroup:
    """One prompt's sessions as a group: the common prefix of their first prompts is the group's
    prompt; what a session's own first prompt adds goes into its completion, masked."""
    eos = worker.tokenizer.eos_token_id
    firsts = [s.prompt_ids for s in sessions if s.turns]
    common = _common_prefix(firsts) if firsts else list(worker.tokenizer(request.prompt)["input_ids"])
    ids, masks, logprobs, finishes, completions, transcripts = [], [], [], [], [], []
    for session, result in zip(sessions, results):
        failed = result.error is not None or not session.turns
        head = session.prompt_ids[len(common):] if session.turns else []
        if failed:  # an agent that raised, hung or never asked: an episode of one masked token, scored 0
            ids.append([eos]), masks.append([0]), logprobs.append([0.0])
        else:
            ids.append(head + session.ids)
            masks.append([0] * len(head) + session.mask)
            logprobs.append([0.0] * len(head) + session.logprobs)
        finishes.append("error" if failed else session.finish)
        answer_text = result.answer if result.answer is not None else "".join(session.texts)
        completions.append("" if failed else answer_text)
        transcripts.append("" if failed else "".join(session.transcript))
    return PromptGroup(index=request.index, prompt=request.prompt, answer=request.answer, fields=dict(request.fields),
                       prompt_ids=common, completions=completions, completion_ids=ids, finish_reasons=finishes, policy_version=version,
                       sampler_logprobs=None if greedy else logprobs, loss_masks=masks, transcripts=transcripts)


def _common_prefix(lists: List[List[int]]) -> List[int]:
    first = lists[0]
    end = len(first)
    for other in lists[1:]:
        end = min(end, len(other))
        end = next((i for i in range(end) if first[i] != other[i]), end)
    return list(first[:end])
