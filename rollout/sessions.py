"""Agent sessions that are token-faithful: what the learner trains on is what the sampler produced.

One session is one trajectory of an agent's episode. Its first request is rendered by the chat
template; every later request that continues the chain (the previous messages, then the reply
the server gave, then new messages) becomes the stored ids (the rendered prompt, every sampled
turn exactly as sampled, every observation) plus the rendering of only the new messages. The
template's own rendering of the conversation is computed too, and where it differs from the stored
ids (a template that is not append-only: one that drops earlier reasoning, loses a separator, or
re-renders an assistant turn) the stored ids win and the drift is counted, with its first
differing turn kept for the run folder.

A request that does not continue the chain (`n` > 1, a side question, an edited history) is
served from its own rendering and counted, never trained.

Pure logic over a `render(messages, tools, add_generation_prompt) -> ids` function: no engine,
no HTTP (the endpoint is rollout/endpoint.py).
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

Render = Callable[[List[dict], Optional[list], bool], List[int]]


@dataclass
class Drift:
    """The first turn where the template's rendering of the history left the stored ids."""
    turn: int
    position: int
    """Index into the session's prompt + completion ids of the first differing token."""
    stored: List[int]
    rendered: List[int]


@dataclass
class Session:
    """One episode of an agent: `prompt_ids` as first rendered, then `ids` with `mask` 1 for each
    sampled token (with its sampler log-prob) and 0 for what the template put around them."""
    id: str
    key: str
    max_tokens: int
    """The episode's token budget (completion side), as rollout.completion_budget gives."""
    prompt_ids: List[int] = field(default_factory=list)
    ids: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    messages: List[dict] = field(default_factory=list)
    """The conversation the last trained turn answered (for the chain check)."""
    texts: List[str] = field(default_factory=list)
    """The text of each sampled turn (the model's side of the transcript)."""
    transcript: List[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    """Tool calls parsed from the sampled turns (the `tool_calls` of the replies)."""
    off_chain: int = 0
    drift: Optional[Drift] = None
    drift_turns: int = 0
    finish: str = "length"
    closed: bool = False

    @property
    def room(self) -> int:
        return self.max_tokens - len(self.ids)

    @property
    def observation_tokens(self) -> int:
        """What the template and the agent's messages put between sampled turns (mask 0)."""
        return len(self.ids) - sum(self.mask)


@dataclass(frozen=True)
class Turn:
    """What a request asks the engine to continue from, and whether it is trained."""
    prompt_ids: List[int]
    trained: bool
    extension: List[int] = field(default_factory=list)
    """Trained turns after the first: the ids appended before sampling (mask 0)."""


def _same_message(a: dict, b: dict) -> bool:
    keys = ("role", "content", "tool_calls", "tool_call_id", "name")
    return all(_normal(a.get(k)) == _normal(b.get(k)) for k in keys)


def _normal(value: Any) -> Any:
    return None if value in ("", [], None) else value


def plan_turn(session: Session, messages: List[dict], tools: Optional[list], n: int, render: Render) -> Turn:
    """How to serve `messages` in `session`: the token-faithful continuation, or off the chain."""
    if n != 1:
        return Turn(render(messages, tools, True), trained=False)
    if session.turns == 0:
        return Turn(render(messages, tools, True), trained=True)
    history = session.messages
    k = len(history)
    continues = (len(messages) > k + 1 and all(_same_message(a, b) for a, b in zip(messages[:k], history))
                 and messages[k].get("role") == "assistant"
                 and all(m.get("role") != "assistant" for m in messages[k + 1:]))
    if not continues:
        return Turn(render(messages, tools, True), trained=False)
    stored = session.prompt_ids + session.ids
    full = render(messages, tools, True)
    if full[:len(stored)] == stored:
        # The template renders the whole conversation as the stored ids and then the rest (the
        # separator after the last turn, the new messages): one rendering is enough. The
        # rendering is most of the endpoint's own cost per request (bench/agent_throughput.py).
        extension = full[len(stored):]
        return Turn(stored + extension, trained=True, extension=extension)
    rendered_history = render(messages[:k + 1], tools, False)
    if rendered_history[:len(stored)] != stored:  # the history alone renders otherwise
        _drift(session, stored, rendered_history)
    else:  # the new messages change how the history renders
        _drift(session, stored, full)
    gap = _gap_after_turn(stored, rendered_history)
    if full[:len(rendered_history)] == rendered_history:
        new = full[len(rendered_history):]
    else:  # render the new messages after a neutral probe instead
        probe = messages[:1]
        base = render(probe, tools, False)
        alone = render(probe + messages[k + 1:], tools, True)
        new = alone[len(base):] if alone[:len(base)] == base else alone
    extension = gap + new
    return Turn(stored + extension, trained=True, extension=extension)


def _drift(session: Session, stored: List[int], rendered: List[int]) -> None:
    """Count a turn whose rendering by the template is not the stored ids; keep the first."""
    session.drift_turns += 1
    if session.drift is None:
        position = next((i for i, (a, b) in enumerate(zip(stored, rendered)) if a != b), min(len(stored), len(rendered)))
        session.drift = Drift(turn=session.turns, position=position, stored=stored[position:position + 64],
                              rendered=rendered[position:position + 64])


def _gap_after_turn(stored: List[int], rendered: List[int]) -> List[int]:
    """What the template writes after the last sampled token (a separator such as `\\n`), taken
    from its rendering of the history (where that differs from the stored ids: after the last
    occurrence of the last stored token near its end)."""
    if rendered[:len(stored)] == stored:
        return rendered[len(stored):]
    last = stored[-1] if stored else None
    ends = [i for i in range(len(rendered) - 1, max(len(rendered) - 16, -1), -1) if rendered[i] == last]
    return rendered[ends[0] + 1:] if ends else []


def record_turn(session: Session, turn: Turn, messages: List[dict], sampled: Sequence[int],
                logprobs: Sequence[float], text: str, decode: Callable[[List[int]], str]) -> None:
    """Append a trained turn: its extension (mask 0), then what the sampler chose (mask 1)."""
    if session.turns == 0:
        session.prompt_ids = list(turn.prompt_ids)
    else:
        session.ids += turn.extension
        session.mask += [0] * len(turn.extension)
        session.logprobs += [0.0] * len(turn.extension)
        session.transcript.append(decode(turn.extension))
    session.ids += list(sampled)
    session.mask += [1] * len(sampled)
    session.logprobs += list(logprobs)
    session.texts.append(text)
    session.transcript.append(text)
    session.messages = [dict(m) for m in messages]
    session.turns += 1


class SessionStore:
    """The run's sessions by id; thread-safe (the HTTP thread and the engine loop share it)."""

    def __init__(self):
        self._sessions: Dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, max_tokens: int) -> Session:
        session = Session(id=secrets.token_urlsafe(16), key=secrets.token_urlsafe(24), max_tokens=max_tokens)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Optional[Session]:
        with self._lock:
            return self._sessions.get(session_id)

    def close(self, session_id: str) -> Optional[Session]:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.closed = True
        return session
