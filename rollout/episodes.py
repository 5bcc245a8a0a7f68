"""Multi-turn episodes: the model generates until it closes a tool call or ends; the call runs
beside the engine; its result is appended as tokens; generation resumes. Token in, token out.

Every episode of a call lives in one vLLM engine at once. A turn is one engine request whose
prompt is the episode's token ids so far (the prompt's, then every turn's sampled ids and
every observation's ids, never the text tokenized again); when it finishes with a call, the
call goes to the tool box and the engine keeps stepping the other episodes; when the result is
back, the next turn joins the running batch (continuous batching; vLLM's prefix cache serves
the shared context). An episode ends when the model ends without a call, at `max_turns`, or at
its token budget (`max_episode_tokens`, model and observation tokens together).

What the learner receives per episode: `ids` (all completion tokens after the prompt), `mask`
(1 where the sampler chose the token, 0 for observations), `logprobs` (the sampler's, 0.0 at
observations, which the mask leaves out of the loss, the KL and the entropy).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from common.backends import StepEngine


@dataclass
class Episode:
    prompt_ids: List[int]
    seed: Optional[int]
    ids: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    model_text: List[str] = field(default_factory=list)
    """The text of each model turn (what verifiers see, joined: never an observation)."""
    transcript: List[str] = field(default_factory=list)
    """Model turns and observations in order."""
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_seconds: float = 0.0
    finish: str = "length"

    @property
    def observation_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)


@dataclass
class Limits:
    max_turns: int
    max_new_tokens: int
    """Per turn."""
    max_episode_tokens: int
    """Model and observation tokens of one episode together."""
    max_model_len: int


def run_episodes(engine: StepEngine, tokenizer, episodes: List[Episode], params: Callable, toolbox, fmt, limits: Limits,
                 greedy: bool) -> Dict[str, float]:
    """Advance every episode to its end on `engine`; `params(episode, turn, max_tokens)` gives a
    turn's sampling parameters. Returns the tool stats of the call (summed)."""
    loop = _EpisodeLoop(engine, tokenizer, episodes, params, toolbox, fmt, limits, greedy)
    loop.run()
    return {
        "turns": float(sum(e.turns for e in episodes)),
        "tool_calls": float(sum(e.calls for e in episodes)),
        "tool_errors": float(sum(e.errors for e in episodes)),
        "tool_timeouts": float(sum(e.timeouts for e in episodes)),
        "tool_seconds": sum(e.tool_seconds for e in episodes),
        "tool_wait_seconds": loop.waited,
        "observation_tokens": float(sum(e.observation_tokens for e in episodes)),
    }


class _EpisodeLoop:
    """One call of run_episodes: engine requests and tool calls in flight, keyed by episode."""

    def __init__(self, engine: StepEngine, tokenizer, episodes: List[Episode], params: Callable, toolbox, fmt,
                 limits: Limits, greedy: bool):
        self.engine, self.tokenizer, self.episodes, self.params = engine, tokenizer, episodes, params
        self.toolbox, self.fmt, self.limits, self.greedy = toolbox, fmt, limits, greedy
        self.requests: Dict[str, int] = {}
        self.calls: Dict[int, object] = {}
        self.waited = 0.0
        self.tag = f"ep{time.monotonic_ns()}"

    def run(self) -> None:
        for i in range(len(self.episodes)):
            self.start_turn(i)
        while self.requests or self.calls:
            if self.requests:
                for out in self.engine.step():
                    if out.finished:
                        self.turn_done(self.requests.pop(out.request_id), out)
            for i in self.ready_calls():
                self.observed(i)

    def ready_calls(self) -> List[int]:
        """Episodes whose tool call has an answer; with only tools left, sleeps until one has."""
        now = time.monotonic()
        ready = [i for i, c in self.calls.items() if c.ready(now)]
        if not ready and self.calls and not self.requests:  # only tools left: sleep until one is done or due
            started = time.monotonic()
            futures = [c.future for c in self.calls.values() if c.future is not None]
            # a call still waiting for a free slot has no deadline yet (its limit counts from
            # when it starts): look again within one time limit at the latest
            due = min(min(c.deadline for c in self.calls.values()) - now, self.toolbox.timeout_s)
            if futures:
                wait(futures, timeout=max(due, 0.0), return_when=FIRST_COMPLETED)
            self.waited += time.monotonic() - started
            now = time.monotonic()
            ready = [i for i, c in self.calls.items() if c.ready(now)]
        return ready

    def start_turn(self, i: int) -> None:
        ep, limits = self.episodes[i], self.limits
        room = min(limits.max_new_tokens, limits.max_episode_tokens - len(ep.ids),
                   limits.max_model_len - len(ep.prompt_ids) - len(ep.ids))
        if room <= 0:
            ep.finish = "length"
            return
        request_id = f"{self.tag}-{i}-{ep.turns}"  # outputs carry this id (vLLM adds a suffix inside)
        self.engine.add_request(request_id, list(ep.prompt_ids) + ep.ids, self.params(ep, ep.turns, room))
        self.requests[request_id] = i

    def turn_done(self, i: int, out) -> None:
        ep, sample = self.episodes[i], out.outputs[0]
        ids = list(sample.token_ids)
        ep.ids += ids
        ep.mask += [1] * len(ids)
        ep.logprobs += ([float(step[t].logprob) for t, step in zip(ids, sample.logprobs)]
                        if not self.greedy and sample.logprobs else [0.0] * len(ids))
        ep.model_text.append(sample.text)
        ep.transcript.append(sample.text)
        ep.turns += 1
        if sample.finish_reason != "stop" or sample.stop_reason not in self.fmt.stop:
            ep.finish = sample.finish_reason or "length"  # ended without a call (EOS, a stop, the budget)
            return
        if ep.turns >= self.limits.max_turns:
            ep.finish = "length"  # a call with no turn left to read its result
            return
        call = self.fmt.parse(sample.text)
        ep.calls += 1
        self.calls[i] = (self.toolbox.submit(call.name, call.arguments) if call.error is None
                         else self.toolbox.malformed(call.error))

    def observed(self, i: int) -> None:
        ep, obs = self.episodes[i], self.calls.pop(i).observation(self.toolbox.max_chars)
        ep.errors += obs.error
        ep.timeouts += obs.timed_out
        ep.tool_seconds += obs.seconds
        text = self.fmt.observation_text(obs.text)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limits = self.limits
        room = min(limits.max_episode_tokens - len(ep.ids), limits.max_model_len - len(ep.prompt_ids) - len(ep.ids))
        ep.ids += ids[:room]
        ep.mask += [0] * len(ids[:room])
        ep.logprobs += [0.0] * len(ids[:room])
        ep.transcript.append(text)
        if len(ids) >= room:
            ep.finish = "length"
            return
        self.start_turn(i)
