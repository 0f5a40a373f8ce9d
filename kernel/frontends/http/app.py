"""The routes: /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions and
/v1/messages, with API keys, body limits and errors in each API's own shape."""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from unikern.frontends.http import anthropic, openai
from unikern.frontends.http.errors import APIError, from_validation
from unikern.frontends.http.generation import ClientGone, Generation, ServerState, until_disconnect
from unikern.frontends.http.metrics import CONTENT_TYPE
from unikern.frontends.http.responses import EventStreamResponse, JSONResponse

log = structlog.get_logger("unikern.http")
Body = TypeVar("Body")
# a client that left gets no answer; this status only shows in logs (nginx's convention)
CLIENT_CLOSED_REQUEST = 499


def _api_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(exc: APIError, api: str) -> JSONResponse:
    body = exc.anthropic_body() if api == "anthropic" else exc.openai_body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("x-api-key")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if given is None and scheme.lower() == "bearer":
        given = token.strip()
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                       code="invalid_api_key")


async def _read(request: Request, body_type: type[Body], limit: int) -> Body:
    """The JSON body decoded into `body_type`; 413 past `limit` bytes, read or declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {declared} bytes; at most {limit} (server.max_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the body is over {limit} bytes (server.max_body_bytes)")
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks), type=body_type)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise from_validation(exc) from None


def build_app(state: ServerState) -> Starlette:
    params = state.params
    started = int(time.time())

    def v1(api: str, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                _authorize(request, params.api_key)
                return await handler(request)
            except APIError as exc:
                state.metrics.rejected.labels(str(exc.status)).inc()
                return error_response(exc, api)
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED_REQUEST)

        return endpoint

    def require_engine() -> None:
        if not state.ready:
            status = "stopping" if state.draining else "starting"
            raise APIError(503, f"the server is {status}", headers={"Retry-After": "1"})

    async def openai_call(request: Request, chat: bool) -> Response:
        """/v1/chat/completions (chat) and /v1/completions: the same flow, two body shapes."""
        require_engine()
        body_type = openai.ChatRequest if chat else openai.CompletionRequest
        body = await _read(request, body_type, params.max_body_bytes)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        prepared = openai.prepare_chat(state, body) if chat else openai.prepare_completion(body, state.tokenizer)
        gen = Generation(state, prepared, rid)
        shaper = openai.Shaper(state, gen, rid, chat=chat, token_ids=body.return_token_ids)
        return await respond(request, gen, body.stream, lambda: shaper.stream(body.include_usage), shaper.collect)

    async def chat(request: Request) -> Response:
        return await openai_call(request, chat=True)

    async def completions(request: Request) -> Response:
        return await openai_call(request, chat=False)

    async def messages(request: Request) -> Response:
        require_engine()
        body = await _read(request, anthropic.MessagesRequest, params.max_body_bytes)
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        prepared = anthropic.prepare_messages(state, body)
        gen = Generation(state, prepared, rid)
        shaper = anthropic.Shaper(state, gen, rid, len(prepared.prompt_tokens or ()))
        return await respond(request, gen, body.stream, shaper.stream, shaper.collect)

    async def respond(
        request: Request, gen: Generation, stream: bool,
        events: Callable[[], AsyncIterator[bytes]], collect: Callable[[], Awaitable[dict[str, Any]]],
    ) -> Response:
        await gen.start(request)
        if stream:
            return EventStreamResponse(events(), on_close=gen.aclose)
        try:
            return JSONResponse(await until_disconnect(request, collect))
        finally:
            await gen.aclose()

    # one model card that both APIs' clients read: OpenAI's fields and Anthropic's
    card = {
        "id": state.model_id, "object": "model", "created": started, "owned_by": "unikern",
        "type": "model", "display_name": state.model_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }

    async def models(request: Request) -> Response:
        listing = {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return JSONResponse(listing)

    async def model(request: Request) -> Response:
        if request.path_params["model_id"] != state.model_id:
            raise APIError(404, f"no model {request.path_params['model_id']!r}; this server has {state.model_id!r}",
                           param="model", code="model_not_found")
        return JSONResponse(card)

    async def count_tokens(request: Request) -> Response:
        require_engine()
        body = await _read(request, anthropic.CountTokensRequest, params.max_body_bytes)
        prepared = anthropic.prepare_messages(state, anthropic.MessagesRequest(model=body.model, max_tokens=1, **body.fields()))
        return JSONResponse({"input_tokens": len(prepared.prompt_tokens or ())})

    async def health(request: Request) -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        status = "draining" if state.draining else "starting"
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})

    async def metrics(request: Request) -> Response:
        stats = state.engine.stats if state.engine is not None else None
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=exc.headers)
        return error_response(error, _api_of(request.url.path))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("request failed", path=request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"), _api_of(request.url.path))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", v1("openai", models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", v1("openai", model), methods=["GET"]),
        Route("/v1/messages/count_tokens", v1("anthropic", count_tokens), methods=["POST"]),
        Route("/v1/chat/completions", v1("openai", chat), methods=["POST"]),
        Route("/v1/completions", v1("openai", completions), methods=["POST"]),
        Route("/v1/messages", v1("anthropic", messages), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
