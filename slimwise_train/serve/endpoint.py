"""The OpenAI-compatible endpoint in front of a `ServingEngine` (Starlette on uvicorn).

Routes: POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models, GET /health (no key
needed: it tells only whether the engine processes run), GET /metrics (Prometheus text). Every other route needs
`Authorization: Bearer <key>`. No CORS header is sent unless origins are named (`--cors-origin`), and never with
credentials: a web page the user opens cannot call the endpoint.

Admission: at most `engine.slots` requests run; up to `queue` more wait; beyond that a request is answered 429 with
Retry-After at once (memory stays bounded: a waiting request holds only its parsed body, at most `max_body` bytes).
A prompt that does not fit the context is a 400 naming the limit; an engine process that fails mid-request a 502
(before the first token) or an error event in the stream (after it), each one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
import uuid
from dataclasses import dataclass

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slimwise_train.serve.engine import (BackendFailed, Overloaded, PromptTooLong, Request, RequestTiming, ServingEngine,
                                         check_fits)

FINISH = {"eos": "stop", "stop": "stop", "budget": "length", "tool_calls": "tool_calls"}
# OpenAI parameters this endpoint cannot honour: refused unless they hold their default value
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
               "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0}


class BadRequest(ValueError):
    pass


@dataclass
class EndpointSettings:
    api_key: str
    queue: int = 64  # requests waiting beyond the running ones
    max_body: int = 1 << 20  # bytes of a request body
    cors_origins: tuple[str, ...] = ()
    retry_after_s: int = 1


class Metrics:
    """The endpoint's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("slimwise_requests", "requests answered, by route and outcome", ["route", "outcome"],
                                registry=r)
        self.queue_depth = Gauge("slimwise_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("slimwise_requests_running", "requests being served", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("slimwise_time_to_first_token_seconds", "prefill and first token, per request",
                              buckets=buckets, registry=r)
        self.decode_tok_s = Histogram("slimwise_decode_tokens_per_second", "decode speed per request (tokens after "
                                      "the first / decode seconds)", buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000,
                                                                              2500, 5000), registry=r)
        self.decode_tokens = Counter("slimwise_decode_tokens", "tokens made by the decode phase", registry=r)
        self.decode_seconds = Counter("slimwise_decode_seconds", "seconds spent in the decode phase, summed over "
                                      "requests", registry=r)
        self.handoff_bytes = Counter("slimwise_handoff_bytes", "sequence state moved from prefill to decode",
                                     registry=r)
        self.handoff_seconds = Histogram("slimwise_handoff_seconds", "save + restore of one request's state",
                                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
                                         registry=r)
        self.restarts = Gauge("slimwise_engine_restarts", "engine processes restarted after they died", ["process"],
                              registry=r)

    def record(self, timing: RequestTiming, handoff: bool) -> None:
        self.ttft.observe(timing.ttft_s)
        if timing.decode_tokens and timing.decode_s > 0:
            self.decode_tok_s.observe(timing.decode_tokens / timing.decode_s)
        self.decode_tokens.inc(timing.decode_tokens)
        self.decode_seconds.inc(timing.decode_s)
        if handoff:
            self.handoff_bytes.inc(timing.handoff_bytes)
            self.handoff_seconds.observe(timing.handoff_s)


class Admission:
    """At most `running` requests at once, at most `queue` waiting; `enter` refuses at once beyond that."""

    def __init__(self, running: int, queue: int, metrics: Metrics):
        self._slots = asyncio.Semaphore(running)
        self._capacity = running
        self._queue = queue
        self._waiting = 0
        self._running = 0
        self._metrics = metrics

    def enter(self) -> "Ticket":
        if self._running + self._waiting >= self._capacity + self._queue:
            raise Overloaded(f"{self._running} requests running and {self._waiting} waiting (the queue holds "
                             f"{self._queue}): retry later")
        self._waiting += 1
        self._metrics.queue_depth.set(self._waiting)
        return Ticket(self)


class Ticket:
    def __init__(self, admission: Admission):
        self._admission = admission
        self._state = "waiting"

    async def wait(self) -> None:
        a = self._admission
        try:
            await a._slots.acquire()
        finally:
            a._waiting -= 1
            a._metrics.queue_depth.set(a._waiting)
        a._running += 1
        a._metrics.running.set(a._running)
        self._state = "running"

    def release(self) -> None:
        a = self._admission
        if self._state == "waiting":  # never got a slot: the client went away while it waited
            return
        if self._state == "running":
            a._running -= 1
            a._metrics.running.set(a._running)
            a._slots.release()
        self._state = "done"


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{key} must be finite, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"{key} must be in [{low}, {high}], got {value!r}")
    return kind(value)


class _Stream(StreamingResponse):
    """A server-sent event stream that ends the engine's generation as soon as the client goes away (the body
    iterator is closed whatever ends the response, so the engine frees its slots at once)."""

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def build_app(engine: ServingEngine, settings: EndpointSettings, log=print, manage_engine: bool = True) -> Starlette:
    """The app; `manage_engine`: start the engine when the app starts and close it when it stops (else the caller
    does, as `serve up` does to report a failed start in one line)."""
    metrics = Metrics()
    admission = Admission(engine.slots, settings.queue, metrics)
    handoff = bool(getattr(engine, "decode_gguf", None))
    created = int(time.time())

    def authorized(request: HTTPRequest) -> bool:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_key.encode())

    async def read_body(request: HTTPRequest) -> dict:
        size = int(request.headers.get("content-length") or 0)
        if size > settings.max_body:
            raise BadRequest(f"request body of {size} bytes is over this endpoint's limit of {settings.max_body}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > settings.max_body:
                raise BadRequest(f"request body is over this endpoint's limit of {settings.max_body} bytes")
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as error:
            raise BadRequest(f"the body is not JSON ({error.msg})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def common(body: dict) -> dict:
        model = body.get("model")
        if model is not None and model != engine.model_name:
            raise BadRequest(f"model {model!r} is not served here: this endpoint serves {engine.model_name!r} "
                             "(GET /v1/models)")
        for key, default in UNSUPPORTED.items():
            value = body.get(key)
            if value is None or value is False or value == {} or value == default:
                continue
            raise BadRequest(f"{key}={value!r} is not supported by this endpoint (leave it out)")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a non-empty string or a list of them")
        temperature = _number(body, "temperature", 1.0, low=0, high=2)
        if not isinstance(body.get("ignore_eos", False), bool):
            raise BadRequest(f"ignore_eos must be true or false, got {body['ignore_eos']!r}")
        return dict(stop=tuple(stop), temperature=temperature, ignore_eos=body.get("ignore_eos", False),
                    top_p=_number(body, "top_p", 1.0, low=1e-9, high=1),
                    top_k=_number(body, "top_k", 0, int, low=0), seed=_number(body, "seed", 0, int, low=0),
                    stream=bool(body.get("stream", False)),
                    include_usage=bool((body.get("stream_options") or {}).get("include_usage", False)))

    def budget(body: dict, key_names: tuple[str, ...], default: int | None) -> int | None:
        for key in key_names:
            if body.get(key) is not None:
                return _number(body, key, None, int, low=1)
        return default

    async def prompts_of(body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [await engine.tokenize(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [await engine.tokenize(p) for p in prompt]
        if (isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt)
                and all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p)):
            return [list(p) for p in prompt]
        raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    async def fitted(request: Request) -> Request:
        """`request` with its budget set (the rest of the context when the client gave none); PromptTooLong if the
        prompt and budget do not fit."""
        prompt_len = await engine.prompt_length(request)
        if prompt_len == 0:
            raise BadRequest("the prompt is empty")
        if request.max_new_tokens is None:
            request.max_new_tokens = max(engine.n_ctx - prompt_len, 1)
        check_fits(prompt_len, request.max_new_tokens, engine.n_ctx,
                   "lower max_tokens, or start `serve up` with a larger --ctx")
        return request

    def finished(route: str, timing: RequestTiming, outcome: str = "ok") -> None:
        metrics.requests.labels(route, outcome).inc()
        if outcome == "ok":
            metrics.record(timing, handoff)

    async def run(route: str, requests: list[Request], make_chunk, make_final, stream: bool, include_usage: bool):
        """Admit, generate and answer; `make_chunk(index, delta)` is one stream event's object,
        `make_final(results)` the non-streamed answer from [(text, tool_calls, end, usage)] per prompt."""
        try:
            requests = [await fitted(r) for r in requests]
        except BackendFailed as error:
            metrics.requests.labels(route, "engine_failed").inc()
            return _error(502, str(error), "engine_failed")
        tickets = []
        try:
            for _ in requests:
                tickets.append(admission.enter())
        except Overloaded as error:
            for ticket in tickets:
                ticket.release()
            metrics.requests.labels(route, "rejected_busy").inc()
            return _error(429, str(error), "overloaded", {"Retry-After": str(settings.retry_after_s)})
        if not stream:
            async def one(index, req, ticket):
                timing = RequestTiming()
                text, calls, end, usage = "", [], None, {}
                await ticket.wait()
                try:
                    async for delta in engine.generate(req, timing):
                        text += delta.text
                        calls += delta.tool_calls or []
                        end, usage = delta.end or end, delta.usage or usage
                finally:
                    ticket.release()
                finished(route, timing)
                return text, calls, end, usage

            try:
                results = await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(requests, tickets))))
            except BackendFailed as error:
                metrics.requests.labels(route, "engine_failed").inc()
                return _error(502, str(error), "engine_failed")
            finally:
                for ticket in tickets:
                    ticket.release()
            return JSONResponse(make_final(results))
        if len(requests) != 1:
            for ticket in tickets:
                ticket.release()
            return _error(400, "stream=true takes one prompt", "invalid_request_error")
        req, ticket = requests[0], tickets[0]
        timing = RequestTiming()
        generator = engine.generate(req, timing)
        await ticket.wait()
        try:  # the first delta before any byte is sent: a failure up to here is still a proper status
            first = await generator.__anext__()
        except StopAsyncIteration:
            first = None
        except BackendFailed as error:
            ticket.release()
            await generator.aclose()
            metrics.requests.labels(route, "engine_failed").inc()
            return _error(502, str(error), "engine_failed")
        except BaseException:
            ticket.release()
            await generator.aclose()
            raise

        async def events():
            outcome = "client_gone"
            usage = None
            try:
                delta = first
                while delta is not None:
                    usage = delta.usage or usage
                    yield f"data: {json.dumps(make_chunk(0, delta))}\n\n"
                    try:
                        delta = await generator.__anext__()
                    except StopAsyncIteration:
                        delta = None
                if include_usage and usage:
                    yield f"data: {json.dumps(make_chunk(0, None, usage))}\n\n"
                yield "data: [DONE]\n\n"
                outcome = "ok"
            except BackendFailed as error:
                outcome = "engine_failed"
                yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'engine_failed', 'code': 502}})}\n\n"
            finally:
                with anyio.CancelScope(shield=True):  # the engine frees its slots even when the client went away
                    await generator.aclose()
                ticket.release()
                finished(route, timing, outcome)

        return _Stream(events(), media_type="text/event-stream")

    async def guarded(request: HTTPRequest, route: str, handler):
        if not authorized(request):
            metrics.requests.labels(route, "unauthorized").inc()
            return _error(401, "missing or wrong API key: send Authorization: Bearer <key> (the key `serve up` "
                          "printed the file of)", "invalid_api_key")
        try:
            return await handler(await read_body(request))
        except (BadRequest, PromptTooLong, ValueError) as error:
            metrics.requests.labels(route, "bad_request").inc()
            return _error(400, str(error), "invalid_request_error")
        except BackendFailed as error:
            metrics.requests.labels(route, "engine_failed").inc()
            return _error(502, str(error), "engine_failed")

    async def completions(request: HTTPRequest):
        async def handle(body):
            options = common(body)
            max_tokens = budget(body, ("max_tokens",), 16)  # OpenAI's default for completions
            prompts = await prompts_of(body)
            requests = [Request(p, max_tokens, options["stop"], options["temperature"], options["top_p"],
                                options["top_k"], options["seed"], ignore_eos=options["ignore_eos"]) for p in prompts]
            cid = f"cmpl-{uuid.uuid4().hex}"

            def chunk(index, delta, usage=None):
                choices = [] if delta is None else [{"index": index, "text": delta.text, "logprobs": None,
                                                     "finish_reason": FINISH.get(delta.end) if delta.end else None}]
                out = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": engine.model_name,
                       "choices": choices}
                if usage:
                    out["usage"] = _usage([usage])
                return out

            def final(results):
                return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": engine.model_name,
                        "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": FINISH.get(end, "stop")}
                                    for i, (text, _, end, _) in enumerate(results)],
                        "usage": _usage([u for *_, u in results])}

            return await run("completions", requests, chunk, final, options["stream"], options["include_usage"])

        return await guarded(request, "completions", handle)

    async def chat(request: HTTPRequest):
        async def handle(body):
            options = common(body)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise BadRequest("messages must be a non-empty list of objects")
            max_tokens = budget(body, ("max_completion_tokens", "max_tokens"), None)
            chat_body = {k: body[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls",
                                              "chat_template_kwargs", "response_format") if k in body}
            req = Request([], max_tokens, options["stop"], options["temperature"], options["top_p"], options["top_k"],
                          options["seed"], chat=chat_body, ignore_eos=options["ignore_eos"])
            cid = f"chatcmpl-{uuid.uuid4().hex}"
            sent_role = [False]

            def chunk(index, delta, usage=None):
                out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": engine.model_name, "choices": []}
                if delta is not None:
                    piece = {}
                    if not sent_role[0]:
                        piece["role"] = "assistant"
                        sent_role[0] = True
                    if delta.text:
                        piece["content"] = delta.text
                    if delta.tool_calls:
                        piece["tool_calls"] = delta.tool_calls
                    out["choices"] = [{"index": index, "delta": piece,
                                       "finish_reason": FINISH.get(delta.end) if delta.end else None}]
                if usage:
                    out["usage"] = _usage([usage])
                return out

            def final(results):
                text, calls, end, usage = results[0]
                message = {"role": "assistant", "content": text if text or not calls else None}
                if calls:
                    message["tool_calls"] = _merge_tool_calls(calls)
                return {"id": cid, "object": "chat.completion", "created": int(time.time()),
                        "model": engine.model_name,
                        "choices": [{"index": 0, "message": message, "finish_reason": FINISH.get(end, "stop")}],
                        "usage": _usage([usage])}

            return await run("chat", [req], chunk, final, options["stream"], options["include_usage"])

        return await guarded(request, "chat", handle)

    async def models(request: HTTPRequest):
        if not authorized(request):
            metrics.requests.labels("models", "unauthorized").inc()
            return _error(401, "missing or wrong API key", "invalid_api_key")
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                        "created": created, "owned_by": "slimwise_train"}]})

    async def health(request: HTTPRequest):
        state = engine.health()
        ok = all(v == "ok" for v in state.values())
        return JSONResponse({"status": "ok" if ok else "degraded", "engine": state}, status_code=200 if ok else 503)

    async def metrics_route(request: HTTPRequest):
        if not authorized(request):
            return _error(401, "missing or wrong API key", "invalid_api_key")
        for process, count in getattr(engine, "restarts", dict)().items():
            metrics.restarts.labels(process).set(count)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not manage_engine:
            yield
            return
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["authorization", "content-type"],
                                     allow_credentials=False))
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/health", health, methods=["GET"]),
                            Route("/metrics", metrics_route, methods=["GET"])],
                    middleware=middleware, lifespan=lifespan)
    app.state.metrics = metrics
    return app


def _usage(usages: list[dict]) -> dict:
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _merge_tool_calls(deltas: list[dict]) -> list[dict]:
    """OpenAI's streamed tool-call pieces (by index: id, name, argument fragments) joined into whole calls."""
    calls: dict[int, dict] = {}
    for piece in deltas:
        call = calls.setdefault(piece.get("index", 0), {"id": None, "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
