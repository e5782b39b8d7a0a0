"""The HTTP side: an ASGI app (Starlette) with OpenAI's routes, streamed with sse-starlette.

Starlette rather than FastAPI: FastAPI's own validation answers 422 in its own shape, and every
route here must answer OpenAI's {"error": ...} with a 400, so validation is pydantic called
directly (protocol.py). Nothing here touches llama.cpp: prompts are rendered and tokenized in a
worker thread, generation runs on the engine thread (scheduler.py), and events come back through
an asyncio queue, so the event loop never blocks on a decode."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgerun.decode import governor
from edgerun.errors import EdgerunError
from edgerun.serve.metrics import Metrics
from edgerun.serve.protocol import APIError, ChatRequest, CompletionRequest, parse
from edgerun.serve import tools as toolcalls
from edgerun.serve.scheduler import Delta, Done, Failed, Job, Overloaded, Scheduler

PUBLIC = {"/health"}  # answered without a key: a load balancer's probe


@dataclass
class ServerState:
    """What the routes share. `scheduler` is None while the model loads."""

    names: list[str]  # the model's names a request may use; the first is the one /v1/models lists
    api_key: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    scheduler: Scheduler | None = None
    drain_s: float = 10.0  # how long a shutdown lets running streams finish
    created: int = field(default_factory=lambda: int(time.time()))
    _mailbox: "_Mailbox | None" = None

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> "_Mailbox":
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        return self._mailbox


PACE_S = 0.05  # while replies stream, their text leaves at most this often (see _Mailbox)


class _Mailbox:
    """The engine thread's events to the event loop, paced.

    Each call_soon_threadsafe wakes the loop through its self-pipe, and each delivered text is an
    SSE chunk the client must parse, on the same cores as llama.cpp's threads: a wake-up and a
    chunk per token cost a reply alone a measurable share of its speed. So a delivery hands out
    everything posted since the last one, and after it the loop looks again only `pace` seconds
    later (a timer, no wake-up from the engine): a fast reply's tokens leave in chunks at most
    20 times a second. An urgent event (a reply's first text, its end, an error) wakes the loop at
    once, so TTFT and the last token are never held back; when the engine is slower than the pace
    the timer finds nothing and the next event wakes the loop as it comes."""

    IDLE, TIMED, WOKEN = "idle", "timed", "woken"

    def __init__(self, loop: asyncio.AbstractEventLoop, pace: float = PACE_S):
        self.loop, self.pace = loop, pace
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []
        self._state = self.IDLE
        self._timer: asyncio.TimerHandle | None = None

    def post(self, queue: asyncio.Queue, event, *, urgent: bool = True) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if self._state == self.WOKEN or (self._state == self.TIMED and not urgent):
                return
            self._state = self.WOKEN
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._state = self.TIMED if pending else self.IDLE
        for queue, event in pending:
            queue.put_nowait(event)
        if pending and self._timer is None:
            self._timer = self.loop.call_later(self.pace, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._deliver()


class _Sink:
    """A job's events into the mailbox: its first text and its end are urgent, the rest paced."""

    def __init__(self, mailbox: _Mailbox, queue: asyncio.Queue):
        self.mailbox, self.queue, self.started = mailbox, queue, False

    def __call__(self, event) -> None:
        urgent = not (self.started and isinstance(event, Delta))
        self.started = self.started or isinstance(event, Delta)
        self.mailbox.post(self.queue, event, urgent=urgent)


def create_app(state: ServerState, lifespan=None) -> Starlette:
    async def health(_request):
        return _health(state)

    async def metrics(_request):
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4")

    async def models(_request):
        return _models(state)

    async def chat(request):
        return await _complete(state, request, chat=True)

    async def completions(request):
        return await _complete(state, request, chat=False)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, APIError: _api_error, Exception: _internal})
    if state.api_key:
        app.add_middleware(_KeyCheck, key=state.api_key)
    return app


class _KeyCheck:
    """Every route but PUBLIC wants `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "a valid API key is needed: send Authorization: Bearer KEY",
                                 code="invalid_api_key")
                response = await _api_error(None, error)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


async def _api_error(_request, exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return await _api_error(None, APIError(exc.status_code, str(exc.detail), type=kind))


async def _internal(_request, exc: Exception) -> JSONResponse:
    return await _api_error(None, APIError(500, f"internal error ({type(exc).__name__}: {exc})", type="server_error"))


def _health(state: ServerState) -> JSONResponse:
    if state.scheduler is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    running, queued = state.scheduler.load
    return JSONResponse({"status": "ok", "running": running, "queued": queued})


def _models(state: ServerState) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": state.names[0], "object": "model", "created": state.created, "owned_by": "edgerun"}]})


async def _complete(state: ServerState, request: Request, *, chat: bool) -> Response:
    scheduler = state.scheduler
    if scheduler is None:
        raise APIError(503, "the model is still loading; retry in a moment", type="server_error", code="loading")
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    req = parse(ChatRequest if chat else CompletionRequest, body)
    if req.model not in state.names:
        raise APIError(400, f"model '{req.model}' is not served here; this server has '{state.names[0]}'"
                       " (GET /v1/models)", param="model", code="model_not_found")
    runner = scheduler.runner
    grammar, tools = await _constraint(req, runner) if chat else (None, None)
    try:
        if chat:
            messages = [m.for_template() for m in req.messages]
            prompt = await anyio.to_thread.run_sync(runner.chat_tokens, messages, tools)
        else:
            prompt = await anyio.to_thread.run_sync(runner.raw_tokens, req.prompt)
    except EdgerunError as exc:
        raise APIError(400, str(exc), code="invalid_prompt") from None
    if not prompt:
        raise APIError(400, "the prompt has no tokens; give some text", param="prompt", code="invalid_prompt")
    limit = runner.ctx.n_ctx - 1 - governor.K_MAX  # generate() keeps room for one verify batch
    if len(prompt) > limit:
        raise APIError(400, f"the prompt has {len(prompt)} tokens and this server's context holds {runner.ctx.n_ctx}"
                       f" per request (at most {limit} for the prompt); shorten it, or restart the server with a"
                       " larger --ctx", param="messages" if chat else "prompt", code="context_length_exceeded")
    events: asyncio.Queue = asyncio.Queue()
    mailbox = state.mailbox(asyncio.get_running_loop())
    job = Job(prompt, req.sampling(), req.limit or runner.ctx.n_ctx, req.stop,
              sink=_Sink(mailbox, events), grammar=grammar)
    try:
        scheduler.submit(job)
    except Overloaded as exc:
        raise APIError(503, str(exc), type="server_error", code="server_overloaded") from None
    reply = _Reply(req.model, chat, tools=tuple(t["function"]["name"] for t in tools or ()))
    if req.stream:
        return EventSourceResponse(_stream(reply, job, events, req.include_usage), ping=15,
                                   shutdown_grace_period=state.drain_s)  # a shutdown drains
    return JSONResponse(reply.whole(*await _collect(job, events, request)))


async def _constraint(req: ChatRequest, runner):
    """The reply's grammar state (tools or response_format; None: free) and the tools for the
    template. llama.cpp's parse on this model's vocabulary happens here, so a schema or grammar that
    cannot work is a 400 before the request is queued, and the job decodes under this state."""
    tools = [t.for_template() for t in req.tools] if req.tools and req.tool_choice != "none" else None
    param = "tools" if tools else "response_format"
    if tools and not toolcalls.supports_tools(runner.model.info.chat_template):
        raise APIError(400, "this model's chat template has no tool-call format edgerun knows (<tool_call>);"
                       " use a model whose template renders tools (e.g. Qwen2.5)", param="tools", code="invalid_value")
    try:
        if tools:
            constraint = toolcalls.tool_constraint(tools, req.tool_choice, req.parallel_tool_calls)
        else:
            constraint = toolcalls.response_constraint(req.response_format)
        grammar = None if constraint is None else await anyio.to_thread.run_sync(constraint.start, runner.ctx.address)
    except EdgerunError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    return grammar, tools


async def _events(job: Job, events: asyncio.Queue) -> AsyncIterator[Delta | Done | Failed]:
    """The job's events until its last; leaving early (a client gone, a task cancelled) cancels it."""
    first = True
    try:
        while True:
            event = await events.get()
            # text that arrived together goes out together (a reply alone gets a round's tokens
            # at once): one chunk for the client to parse instead of one per token. Not the first
            # text: it alone marks the first token (clients time TTFT and TPOT from it)
            while isinstance(event, Delta) and not first and not events.empty():
                after = events.get_nowait()
                if not isinstance(after, Delta):
                    yield event
                    event = after
                    break
                event = Delta(event.text + after.text)
            first = False
            yield event
            if not isinstance(event, Delta):
                return
    finally:
        job.cancel.set()  # a no-op once the job is done


async def _collect(job: Job, events: asyncio.Queue, request: Request) -> tuple[str, Done]:
    """A non-streamed reply; a client that hangs up meanwhile cancels it."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    parts: list[str] = []
    try:
        async for event in _events(job, events):
            if watch.done():
                raise APIError(499, "the client went away")
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Failed):
                raise APIError(500, event.message, type="server_error")
            else:
                return "".join(parts), event
    finally:
        watch.cancel()
    raise APIError(500, "the reply ended without a result", type="server_error")


async def _stream(reply: "_Reply", job: Job, events: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
    if reply.chat:
        yield json.dumps(reply.chunk(role=True))
    calls = toolcalls.CallParser(reply.tools) if reply.tools else None
    async for event in _events(job, events):
        if isinstance(event, Delta) and calls is not None:
            for part in calls.feed(event.text):
                yield json.dumps(reply.call_chunk(part))
        elif isinstance(event, Delta):
            yield json.dumps(reply.chunk(text=event.text))
        elif isinstance(event, Failed):
            yield json.dumps(APIError(500, event.message, type="server_error").body())
            return
        else:
            if calls is not None:
                for part in calls.finish():
                    yield json.dumps(reply.call_chunk(part))
            yield json.dumps(reply.chunk(finish=_finish_reason(event, calls is not None and bool(calls.calls))))
            if include_usage:
                yield json.dumps(reply.usage_chunk(event))
    yield "[DONE]"


def _finish_reason(done: Done, called: bool) -> str:
    """OpenAI's: a reply that ended on its own after calling tools finished with "tool_calls"."""
    return "tool_calls" if called and done.finish == "stop" else done.finish


class _Reply:
    """The response objects of one request, chat or text completion."""

    def __init__(self, model: str, chat: bool, tools: tuple[str, ...] = ()):
        self.model, self.chat, self.tools = model, chat, tools
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, stream: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if stream and self.chat else ""),
                "created": self.created, "model": self.model}

    @staticmethod
    def _usage(done: Done) -> dict:
        u = done.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    def whole(self, text: str, done: Done) -> dict:
        if self.chat and self.tools:
            content, calls = toolcalls.parse_reply(text, self.tools)
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(done, bool(calls))}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": done.finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish}
        return self._head(False) | {"choices": [choice], "usage": self._usage(done)}

    def chunk(self, *, text: str = "", role: bool = False, finish: str | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if finish is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._head(True) | {"choices": [choice]}

    def call_chunk(self, part) -> dict:
        """A streamed piece of a reply that may call tools: content, a call's start, or its arguments."""
        if isinstance(part, toolcalls.Content):
            return self.chunk(text=part.text)
        if isinstance(part, toolcalls.CallStart):
            call = {"index": part.index, "id": part.id, "type": "function",
                    "function": {"name": part.name, "arguments": ""}}
        else:
            call = {"index": part.index, "function": {"arguments": part.text}}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        return self._head(True) | {"choices": [choice]}

    def usage_chunk(self, done: Done) -> dict:
        return self._head(True) | {"choices": [], "usage": self._usage(done)}
