"""An OpenAI-compatible endpoint on a generation worker, for agents the user writes.

`POST /s/<session>/v1/chat/completions`, `POST /s/<session>/v1/completions` and
`GET /s/<session>/v1/models`, served by a thread of the worker's actor and answered by the same
engine that samples the batch: a request becomes one more request of the engine's step loop
(continuous batching with every other session), never a second copy of the weights. The request
and response bodies are vLLM's own OpenAI protocol types; tool calls in the model's text are
parsed back into `tool_calls` by vLLM's parser for the chat template's format (Hermes, as in
Qwen2.5's template).

Every session has its own unguessable id and key (the `api_key` its client sends): a request
without the key, for an unknown or closed session, malformed, or over the size limit gets a 4xx
with one line, never an exception in the engine loop. What a session trains on is kept by
rollout/sessions.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import queue
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.backends import StepEngine
from common.errors import one_line
from rollout.sessions import Session, SessionStore, Turn, plan_turn, record_turn


class EngineBridge:
    """Requests from the HTTP thread into the engine's step loop (which runs in the actor's call)."""

    def __init__(self):
        self._pending: "queue.Queue[Tuple[str, List[int], Any, concurrent.futures.Future]]" = queue.Queue()
        self._running: Dict[str, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self.served = 0

    def submit(self, prompt_ids: List[int], params) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.put((f"agent-{next(self._ids)}", list(prompt_ids), params, future))
        return future

    @property
    def busy(self) -> bool:
        return bool(self._running) or not self._pending.empty()

    def pump(self, engine: StepEngine, wait_s: float) -> None:
        """Start what was asked, run one engine step, hand back what finished. With nothing in the
        engine, waits up to `wait_s` for a request instead of spinning."""
        if not self._running:
            try:
                item = self._pending.get(timeout=wait_s)
            except queue.Empty:
                return
            self._start(engine, item)
        while True:
            try:
                self._start(engine, self._pending.get_nowait())
            except queue.Empty:
                break
        for out in engine.step():
            if out.finished and out.request_id in self._running:
                self.served += 1
                self._running.pop(out.request_id).set_result(out)

    def _start(self, engine: StepEngine, item) -> None:
        request_id, prompt_ids, params, future = item
        try:
            engine.add_request(request_id, prompt_ids, params)
        except Exception as exc:  # a request the engine refuses (too long, bad params) is the caller's 400
            future.set_exception(ValueError(one_line(exc)))
            return
        self._running[request_id] = future

    def fail_all(self, reason: str) -> None:
        for future in self._running.values():
            future.set_exception(RuntimeError(reason))
        self._running.clear()


class EndpointError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AgentEndpoint:
    """The HTTP front: a uvicorn server in a daemon thread of this process."""

    def __init__(self, tokenizer, sampling: Callable[..., Any], store: SessionStore, bridge: EngineBridge,
                 model_name: str, host: str = "127.0.0.1", max_request_kb: int = 1024, max_model_len: int = 4096):
        self.tokenizer, self.sampling, self.store, self.bridge = tokenizer, sampling, store, bridge
        self.model_name, self.max_request_bytes, self.max_model_len = model_name, max_request_kb * 1024, max_model_len
        self.stats = {"agent_requests": 0, "agent_rejected": 0, "off_chain_calls": 0}
        self._locks: Dict[str, asyncio.Lock] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = None
        self._thread = threading.Thread(target=self._serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not (self._server is not None and self._server.started) and time.monotonic() < deadline:
            time.sleep(0.01)

    def base_url(self, session: Session) -> str:
        return f"http://{self.host}:{self.port}/s/{session.id}/v1"

    def _serve(self) -> None:
        import uvicorn

        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.run(sockets=[self._sock])

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=10)

    def _app(self):
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        async def answer(request: Request, session_id: str, handler) -> JSONResponse:
            self.stats["agent_requests"] += 1
            try:
                session = self._authorize(request, session_id)
                body = await self._body(request)
                return JSONResponse(await handler(session, body))
            except EndpointError as exc:
                self.stats["agent_rejected"] += 1
                return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                               "code": exc.status}}, status_code=exc.status)

        @app.post("/s/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            return await answer(request, session_id, self._chat)

        @app.post("/s/{session_id}/v1/completions")
        async def completions(session_id: str, request: Request):
            return await answer(request, session_id, self._completions)

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str, request: Request):
            async def listing(session, body):
                return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "grpo"}]}
            return await answer(request, session_id, listing)

        return app

    def _authorize(self, request, session_id: str) -> Session:
        session = self.store.get(session_id)
        if session is None:
            raise EndpointError(404, "unknown or closed session")
        key = request.headers.get("authorization", "")
        if key != f"Bearer {session.key}":
            raise EndpointError(401, "missing or wrong api key for this session")
        return session

    async def _body(self, request) -> dict:
        if request.method == "GET":
            return {}
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise EndpointError(413, f"request over {self.max_request_bytes // 1024} KiB")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_request_bytes:
                raise EndpointError(413, f"request over {self.max_request_bytes // 1024} KiB")
        try:
            body = json.loads(raw)
        except ValueError:
            raise EndpointError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise EndpointError(400, "the body is not a JSON object")
        return body

    def _render(self, messages: List[dict], tools: Optional[list], generation: bool) -> List[int]:
        try:
            ids = self.tokenizer.apply_chat_template(_for_template(messages), tools=tools or None, tokenize=True,
                                                     add_generation_prompt=generation, return_dict=False)
        except Exception as exc:
            raise EndpointError(400, f"the chat template cannot render these messages: {exc}"[:300]) from None
        return list(ids)

    async def _chat(self, session: Session, body: dict) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = _parse(ChatCompletionRequest, body)
        messages, tools = body["messages"], body.get("tools")
        lock = self._locks.setdefault(session.id, asyncio.Lock())
        async with lock:  # one turn of a session at a time: the chain is a sequence
            turn = plan_turn(session, messages, tools, request.n or 1, self._render)
            outputs = await self._sample(session, turn, request)
            response = self._chat_response(request, tools, turn, outputs)
            if turn.trained:
                self._record(session, turn, messages, outputs[0])
                session.tool_calls += len(response["choices"][0]["message"].get("tool_calls") or [])
        return response

    async def _completions(self, session: Session, body: dict) -> dict:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = _parse(CompletionRequest, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            raise EndpointError(400, "prompt: one string or one list of token ids")
        stored = session.prompt_ids + session.ids
        lock = self._locks.setdefault(session.id, asyncio.Lock())
        async with lock:
            if (request.n or 1) != 1 or (session.turns and ids[:len(stored)] != stored):
                turn = Turn(ids, trained=False)
            else:
                turn = Turn(ids, trained=True, extension=ids[len(stored):] if session.turns else [])
            outputs = await self._sample(session, turn, request)
            if turn.trained:
                self._record(session, turn, session.messages, outputs[0])
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason or "length",
                    "logprobs": None, "token_ids": list(c.token_ids)} for i, c in enumerate(outputs)]
        return {"id": f"cmpl-{session.id[:8]}-{session.turns}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": _usage(len(turn.prompt_ids), outputs)}

    async def _sample(self, session: Session, turn: Turn, request) -> list:
        if not turn.trained:
            self.stats["off_chain_calls"] += 1
            session.off_chain += 1
        room = min(session.room if turn.trained else self.max_model_len,
                   self.max_model_len - len(turn.prompt_ids))
        if room <= 0:
            raise EndpointError(400, "this session's token budget is spent")
        max_tokens = min(request.max_tokens or room, room)
        params = self.sampling(n=request.n or 1, temperature=request.temperature, top_p=request.top_p,
                               max_tokens=max_tokens, stop=request.stop, seed=request.seed,
                               turn=(session.id, session.turns), trained=turn.trained)
        try:
            out = await asyncio.wrap_future(self.bridge.submit(turn.prompt_ids, params))
        except ValueError as exc:
            raise EndpointError(400, str(exc)) from None
        except RuntimeError as exc:
            raise EndpointError(503, str(exc)) from None
        return list(out.outputs)

    def _record(self, session: Session, turn: Turn, messages: List[dict], completion) -> None:
        ids = list(completion.token_ids)
        logprobs = [float(step[t].logprob) for t, step in zip(ids, completion.logprobs or [])]
        if len(logprobs) != len(ids):
            logprobs = [0.0] * len(ids)
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
        record_turn(session, turn, messages, ids, logprobs, completion.text, decode)
        session.finish = completion.finish_reason or "length"

    def _chat_response(self, request, tools: Optional[list], turn: Turn, outputs: list) -> dict:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage)
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        choices = []
        for i, c in enumerate(outputs):
            content, calls = c.text, []
            if tools:
                content, calls = self._tool_calls(c.text, request)
            choices.append(ChatCompletionResponseChoice(
                index=i, message=ChatMessage(role="assistant", content=content, tool_calls=calls),
                finish_reason="tool_calls" if calls else (c.finish_reason or "length"),
                token_ids=list(c.token_ids)))
        usage = UsageInfo(**_usage(len(turn.prompt_ids), outputs))
        response = ChatCompletionResponse(model=self.model_name, choices=choices, usage=usage)
        return response.model_dump(mode="json", exclude_none=True)

    def _tool_calls(self, text: str, request):
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        info = Hermes2ProToolParser(self.tokenizer).extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        return info.content, info.tool_calls


def _parse(kind, body: dict):
    from pydantic import ValidationError

    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise EndpointError(400, f"{where}: {first.get('msg')}"[:300]) from None
    except Exception as exc:  # validators that fail on a wrong type with their own exception
        raise EndpointError(400, f"malformed request: {type(exc).__name__}: {exc}"[:300]) from None


def _usage(prompt_tokens: int, outputs: list) -> dict:
    completion = sum(len(c.token_ids) for c in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _for_template(messages: List[dict]) -> List[dict]:
    """Messages as chat templates read them: tool-call arguments as objects (the OpenAI wire
    format sends them as JSON strings), contents of None as empty strings."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = json.loads(json.dumps(call))
                fn = call.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out
