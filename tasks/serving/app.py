"""The OpenAI-compatible front of ``grpoflow serve``: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health`` and ``/metrics``. Each request is answered by the version served when it arrived (to its end, across a
switch); its ``model`` and the ``X-Grpoflow-*`` headers name the registered model, alias and version.

Taken from a request: ``messages`` (or ``prompt``), ``max_tokens`` (or ``max_completion_tokens``), ``temperature``
(OpenAI's default, 1.0; 0 is greedy), ``n``, ``seed`` and ``stream`` (the whole answer as one chunk, then
``[DONE]``). Other fields are ignored, as vLLM ignores what it does not use. The model's own tool calls come back as
its text: the client runs the tools.
Must not import: Prefect, MLflow, the stages, torch or transformers (the engine does the compute).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tasks.serving.engines import Completion, Engine
from tasks.serving.follower import AliasFollower, ServedVersion
from tasks.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The request's body is not one the endpoint takes; answered 400 with the reason."""


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error in OpenAI's shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def sampling_of(body: dict[str, Any], limit: int) -> dict[str, Any]:
    """The sampling settings a request asks for, checked.

    >>> sampling_of({"max_tokens": 8, "temperature": 0}, 64)
    {'max_tokens': 8, 'temperature': 0.0, 'n': 1, 'seed': 0}
    >>> sampling_of({"max_tokens": 100}, 64)
    Traceback (most recent call last):
    ...
    tasks.serving.app.BadRequest: max_tokens 100 is above this server's limit of 64 (serving.max_tokens_limit)
    """
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or min(256, limit)
    temperature = body.get("temperature")
    n, seed = body.get("n") or 1, body.get("seed") or 0
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_tokens > limit:
        raise BadRequest(f"max_tokens {max_tokens} is above this server's limit of {limit} (serving.max_tokens_limit)")
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, int | float) or temperature < 0:
        raise BadRequest(f"temperature must be a number of at least 0, got {temperature!r}")
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise BadRequest(f"n must be an integer from 1 to 16, got {n!r}")
    if not isinstance(seed, int):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    return {"max_tokens": max_tokens, "temperature": float(temperature), "n": n, "seed": seed}


def messages_of(body: dict[str, Any]) -> list[dict[str, str]]:
    """A chat request's messages: a non-empty list of ``{"role", "content"}`` with text content (OpenAI's list of
    text parts is joined).

    >>> messages_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    [{'role': 'user', 'content': 'hi'}]
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{index}] must be an object with a role")
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{index}].content must be text")
        checked.append({"role": message["role"], "content": content})
    return checked


def build_app(
    follower: AliasFollower, engine: Engine, metrics: ServingMetrics, max_tokens_limit: int, api_key: str | None
) -> Starlette:
    """The server's routes over ``follower`` (which version answers) and ``engine`` (which computes)."""
    served_id = f"{follower.registered_model}@{follower.alias}"

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), api_key.encode())

    def headers(served: ServedVersion) -> dict[str, str]:
        return {
            "X-Grpoflow-Model": served.registered_model,
            "X-Grpoflow-Alias": served.alias,
            "X-Grpoflow-Version": served.version,
        }

    async def answer(request: Request, chat: bool) -> Response:
        if not authorized(request):
            return error(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error")
        started = time.perf_counter()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            requested = body.get("model")
            if requested not in (None, "", served_id, follower.registered_model):
                return error(404, f"model {requested!r} is not served here; this server serves {served_id!r}")
            sampling = sampling_of(body, max_tokens_limit)
            messages = messages_of(body) if chat else None
            prompt = None if chat else body.get("prompt")
            if not chat and not isinstance(prompt, str):
                raise BadRequest("prompt must be one string")
        except (BadRequest, json.JSONDecodeError) as exc:
            return error(400, str(exc))
        served = follower.acquire()
        if served is None:
            return error(503, f"no version of {served_id} is served yet", "service_unavailable")
        status = 500
        try:
            if chat:
                answers = await run_in_threadpool(engine.chat, served.key, messages, served.system_prompt, **sampling)
            else:
                answers = await run_in_threadpool(engine.complete, served.key, prompt, **sampling)
            status = 200
        except Exception as exc:
            logger.exception("serve: %s failed a request", served.model_id)
            return error(500, f"the engine failed: {str(exc)[:200]}", "server_error")
        finally:
            follower.release(served)
            metrics.observe(served.version, status, time.perf_counter() - started)
        payload = completion_payload(served, answers, chat)
        if body.get("stream"):
            return StreamingResponse(
                stream_events(payload, chat), media_type="text/event-stream", headers=headers(served)
            )
        return JSONResponse(payload, headers=headers(served))

    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    async def models(request: Request) -> Response:
        if not authorized(request):
            return error(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error")
        status = follower.status()
        card = {"id": served_id, "object": "model", "created": int(time.time()), "owned_by": "grpoflow"}
        return JSONResponse({"object": "list", "data": [card | {"grpoflow": status}]})

    async def health(request: Request) -> Response:
        served = follower.current
        if served is None:
            return JSONResponse({"status": "waiting", "serving": None}, status_code=503)
        return JSONResponse({"status": "ok", "serving": served.model_id, "since": served.since})

    async def metrics_page(request: Request) -> Response:
        if not authorized(request):
            return error(401, "a valid API key is required (Authorization: Bearer ...)", "authentication_error")
        served = follower.current
        text = metrics.prometheus(served.version if served else None, follower.in_flight())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    return Starlette(routes=routes)


def completion_payload(served: ServedVersion, answers: list[Completion], chat: bool) -> dict[str, Any]:
    """An OpenAI completion object for ``answers``, naming the version that gave them."""
    choices = [
        {"index": i, "finish_reason": a.finish_reason}
        | ({"message": {"role": "assistant", "content": a.text}} if chat else {"text": a.text, "logprobs": None})
        for i, a in enumerate(answers)
    ]
    prompt_tokens = answers[0].prompt_tokens if answers else 0
    completion_tokens = sum(a.completion_tokens for a in answers)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": served.model_id,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "grpoflow": {"registered_model": served.registered_model, "alias": served.alias, "version": served.version},
    }


async def stream_events(payload: dict[str, Any], chat: bool) -> Any:
    """The answer as server-sent events: each choice's whole text in one chunk, its finish reason, ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    for choice in payload["choices"]:
        delta = {"delta": {"role": "assistant", "content": choice["message"]["content"]}} if chat else {}
        text = {} if chat else {"text": choice["text"]}
        chunk = {k: payload[k] for k in ("id", "created", "model")} | {"object": kind}
        yield f"data: {json.dumps(chunk | {'choices': [{'index': choice['index'], **delta, **text}]})}\n\n"
        end = {"index": choice["index"], "finish_reason": choice["finish_reason"]} | ({"delta": {}} if chat else {})
        yield f"data: {json.dumps(chunk | {'choices': [end]})}\n\n"
    yield "data: [DONE]\n\n"
