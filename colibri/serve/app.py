"""The FastAPI application: routes, API key, body size limit, errors, metrics.

    app = create_app(Service(engine, "demo", parallel=4, api_key=None))

Routes: GET / (the dashboard, colibri/serve/dashboard.py, with its /static files and
/v1/experts feeds), GET /health, GET /metrics, GET /v1/models[/ID], POST /v1/completions,
POST /v1/chat/completions, POST /v1/messages (Anthropic), POST /v1/batch (JSONL in, JSONL
out). Every refused request gets a 4xx with an OpenAI-style error body (Anthropic-style on
/v1/messages), unknown paths and methods too; an unexpected failure gets a 500 with the same
body and the server goes on.
The engine is opened and closed by the caller (colibri.serve.cli), not by the app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException

from colibri.serve import anthropic_api, dashboard, openai_api
from colibri.serve.errors import APIError, error_body, error_response
from colibri.serve.service import Service

log = logging.getLogger("colibri.serve")

DEFAULT_MAX_BODY = 32 << 20  # bytes of a request body (a /v1/batch file included)


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes` (by Content-Length, or counted);
    `rejected(path)` is called for each one answered by Content-Length alone (the counted
    case reaches the app's own middleware)."""

    def __init__(
        self, app: Any, max_bytes: int, rejected: Callable[[str], None] | None = None
    ) -> None:
        self.app, self.max_bytes, self.rejected = app, max_bytes, rejected

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"request body larger than {self.max_bytes} bytes")
        for k, v in scope.get("headers", ()):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                if self.rejected is not None:
                    self.rejected(scope["path"])
                return await error_response(too_big, scope["path"])(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, too_big.message)
            return msg

        await self.app(scope, limited, send)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # [[[[...]]]] deeper than the parser's stack
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None


def create_app(
    service: Service, max_body_bytes: int = DEFAULT_MAX_BODY, atlas_trace: str | None = None
) -> FastAPI:
    """The ASGI app serving `service` (see the module docstring); atlas_trace: a routing
    trace (.npz, colibri/io/trace.py) the dashboard's atlas starts from."""
    app = FastAPI(title="colibri", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    metrics = service.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(HTTPException)  # unknown paths, wrong methods: the API's bodies
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("error in %s", request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return error_response(err, request.url.path)

    @app.middleware("http")
    async def _auth_and_count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        path = request.url.path
        if service.api_key and path.startswith("/v1/"):
            given = request.headers.get("x-api-key")
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:].strip()
            if given is None or not secrets.compare_digest(given, service.api_key):
                metrics.requests.labels(path, "401").inc()
                return error_response(
                    APIError(401, "invalid or missing API key (Authorization: Bearer KEY)"), path
                )
        try:
            response = await call_next(request)
        except APIError as exc:  # raised by BodyLimit while the body was read
            response = error_response(exc, path)
        metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = service.statistics()
        return {
            "status": "ok",
            "model": service.model_id,
            "running": s.running,
            "waiting": s.waiting,
            "leased": s.leased,
            "reads_in_flight": s.reads_in_flight,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        eng = service.engine
        return {
            "id": service.model_id,
            "object": "model",
            "created": service.created,
            "owned_by": "colibri",
            "max_model_len": eng.n_ctx,
            "model_type": eng.spec.model_type,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        service.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await openai_api.completions(service, request, await _json_body(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await openai_api.chat_completions(service, request, await _json_body(request))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        return await anthropic_api.messages(service, request, await _json_body(request))

    handlers = {
        "/v1/completions": openai_api.completions,
        "/v1/chat/completions": openai_api.chat_completions,
    }

    @app.post("/v1/batch")
    async def batch(request: Request) -> Response:
        """JSONL of OpenAI batch lines ({"custom_id", "method", "url", "body"}) in, JSONL
        of {"id", "custom_id", "response": {"status_code", "body"}, "error"} out, in input
        order. Lines run concurrently, at most --parallel at a time; streaming is refused."""
        raw = (await request.body()).decode("utf-8", "replace")
        lines = [(n, s) for n, s in enumerate(raw.splitlines(), 1) if s.strip()]
        if not lines:
            raise APIError(400, "the batch is empty (one JSON request per line)")
        limit = asyncio.Semaphore(service.admission.parallel)

        async def one(n: int, text: str) -> dict[str, Any]:
            custom_id = None
            try:
                try:
                    item = json.loads(text)
                except ValueError as exc:
                    raise APIError(400, f"line {n}: not valid JSON: {exc}") from None
                if not isinstance(item, dict):
                    raise APIError(400, f"line {n}: must be a JSON object")
                custom_id = item.get("custom_id")
                url = item.get("url", "/v1/chat/completions")
                body = item.get("body")
                if url not in handlers:
                    raise APIError(400, f"line {n}: url {url!r} (use one of {sorted(handlers)})")
                if isinstance(body, dict) and body.get("stream"):
                    raise APIError(400, f"line {n}: stream is not supported in a batch")
                async with limit:
                    resp = await handlers[url](service, request, body)
                status, payload = resp.status_code, json.loads(resp.body)
            except APIError as exc:
                status, payload = exc.status, error_body(exc, anthropic=False)
            return {
                "id": f"batch_req_{n}",
                "custom_id": custom_id,
                "response": {"status_code": status, "body": payload},
                "error": None if status < 400 else payload["error"],
            }

        results = await asyncio.gather(*(one(n, s) for n, s in lines))
        out = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
        return Response(out, media_type="application/jsonl")

    dashboard.install(app, service, atlas_trace)
    app.state.started = time.time()
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        rejected=lambda path: metrics.requests.labels(path, "413").inc(),
    )
    return app
