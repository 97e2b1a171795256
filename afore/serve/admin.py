"""The admin endpoint of ``afore serve`` (FastAPI on uvicorn, in a thread of the launcher).

Routes (OpenAPI page at ``/docs``, schema at ``/openapi.json``):

- ``GET /afore/status``: this node's role, policy, model, worker counts and child processes;
- ``GET /health``: 200 ``{"status": "ok"}`` while every process of the node is up, else 503 with
  ``degraded`` (scheduler restarting or failed: served primary-only) or ``failing`` (an FFN
  worker or vLLM exited), the dead processes and the reason (afore.serve.supervisor);
- ``POST /afore/policy`` with ``{"policy": NAME}``: restart the scheduler with another placement
  policy (serving goes on meanwhile on primary-only plans; ``--planner workers``: post it on the
  FFN workers' policy board); answers the new status;
- ``GET /metrics``: on the FFN node (role ffn, no vLLM there) afore's Prometheus families of every
  process of the node (docs/metrics.md); 404 on the other roles, whose API port serves them.

Errors are JSON ``{"error": "<field>: <what was expected, what came>", "field": "<field>"}``:
400 for a bad request (malformed JSON, a missing or unknown field, an unknown policy, a switch
on the attention node), 500 when the new scheduler failed to start. The launcher is reached
only through :class:`Controlled`, so the endpoint is testable without starting any process.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Literal, Protocol

import fastapi
import prometheus_client
import pydantic
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afore.scheduler.policies import POLICY_NAMES

log = logging.getLogger("afore.serve.admin")


class Controlled(Protocol):
    """What the admin endpoint needs from the launcher."""

    def status(self) -> dict: ...

    def health(self) -> tuple[int, dict]: ...

    def switch_policy(self, policy: str) -> None: ...

    def metrics_exposition(self) -> bytes | None: ...


class ProcessStatus(pydantic.BaseModel):
    pid: int
    alive: bool


class DataPlaneStatus(pydantic.BaseModel):
    transport: str = pydantic.Field(description="shm (shared buffers on one node), or the torch.distributed backend: gloo, nccl")
    exact: bool = pydantic.Field(description="FFN replies a row per token-expert pair, summed as plain vLLM sums them (--exact)")
    exchange: str | None = pydantic.Field(None, description="shm: stream (capturable, on the CUDA stream) or host")
    microbatches: int
    segment: str | None = pydantic.Field(None, description="shm: the segment's name in /dev/shm (attention ends attach by it)")
    layout: dict | None = pydantic.Field(None, description="shm: the segment's layout (afore.transport.shm.ShmLayout fields)")


class Status(pydantic.BaseModel):
    """``GET /afore/status``. Keys that a node does not have are left out (``ffn_ready``: role ffn
    only, ``ffn_node``: role attention only, ``policy`` is null on the attention node)."""

    # extra keys of Launcher.status() pass through, so a new field needs no change here
    model_config = pydantic.ConfigDict(extra="allow")

    role: Literal["all", "ffn", "attention"]
    policy: str | None = pydantic.Field(description="placement policy of the running scheduler")
    model: str = pydantic.Field(description="checkpoint directory served")
    attn_workers: int
    ffn_workers: int
    planner: str | None = pydantic.Field(None, description="who plans each target: scheduler (the scheduler process) or "
                                                         "workers (every FFN worker, replicated); absent on role attention")
    data_plane: DataPlaneStatus | None = pydantic.Field(None, description="how tokens travel between the pools")
    processes: dict[str, ProcessStatus] = pydantic.Field(description="child processes by name: scheduler, ffn-<w>, vllm")
    ffn_ready: int | None = pydantic.Field(None, description="role ffn: FFN workers loaded and connected")
    ffn_node: str | None = pydantic.Field(None, description="role attention: the FFN node's store address")


class PolicyRequest(pydantic.BaseModel):
    """``POST /afore/policy``."""

    model_config = pydantic.ConfigDict(extra="forbid")

    policy: Literal[POLICY_NAMES] = pydantic.Field(description="placement policy to switch to")  # type: ignore[valid-type]


class AdminError(pydantic.BaseModel):
    error: str = pydantic.Field(description="'<field>: <expected>, got <value>' or the start failure")
    field: str | None = pydantic.Field(None, description="the request field at fault, when one is")


def _error(code: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=code, content=AdminError(error=message, field=field).model_dump(exclude_none=True))


def _field_of(message: str) -> str | None:
    """The field an afore ValueError names ('policy: expected ...' -> 'policy')."""
    head, sep, _ = message.partition(":")
    return head if sep and head.isidentifier() else None


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the first failing field (the body's key path, e.g. ``policy``; ``body``
    when the body itself is not a JSON object)."""
    first = exc.errors()[0]
    # loc: ("body", key, ...); for malformed JSON ("body", character offset)
    loc = [str(p) for p in first.get("loc", ()) if isinstance(p, str) and p != "body"]
    field = ".".join(loc) or "body"
    if first.get("type") == "literal_error":
        message = f"{field}: expected one of {', '.join(POLICY_NAMES)}, got {first.get('input')!r}"
    elif first.get("type") == "json_invalid":
        message = "body: expected a JSON object {\"policy\": NAME}, got malformed JSON"
    else:
        message = f"{field}: {first.get('msg', 'invalid')}"
        if "input" in first and first["type"] != "missing":
            message += f", got {first['input']!r}"
    return _error(400, message, field)


def build_app(launcher: Controlled) -> fastapi.FastAPI:
    """The admin application over ``launcher`` (a :class:`Controlled`)."""
    app = fastapi.FastAPI(title="afore admin", summary="status and placement policy of a running afore serve")
    errors: dict[int | str, dict[str, Any]] = {400: {"model": AdminError}, 500: {"model": AdminError}}

    @app.middleware("http")
    async def _bodies_are_json(request: fastapi.Request, call_next):
        # `curl -d '{"policy": ...}'` sends application/x-www-form-urlencoded; the admin's bodies
        # are JSON whatever the header says (as the http.server handler it replaced read them)
        if request.method == "POST":
            request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"] + \
                [(b"content-type", b"application/json")]
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc)

    # starlette's class: the router raises it for unknown paths and methods (404, 405)
    @app.exception_handler(StarletteHTTPException)
    async def _http(request: fastapi.Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.get("/afore/status", response_model=Status, response_model_exclude_none=True)
    def status() -> dict:
        return launcher.status()

    @app.get("/health")
    def health() -> Any:
        code, body = launcher.health()
        return JSONResponse(status_code=code, content=body)

    # sync handlers: FastAPI runs them in its thread pool, so a switch (seconds) blocks no other request
    @app.post("/afore/policy", response_model=Status, response_model_exclude_none=True, responses=errors)
    def switch_policy(body: PolicyRequest) -> Any:
        try:
            launcher.switch_policy(body.policy)
        except ValueError as exc:
            return _error(400, str(exc), _field_of(str(exc)))
        except Exception as exc:  # noqa: BLE001  (the scheduler failed to start: serving goes on primary-only)
            return _error(500, f"{type(exc).__name__}: {exc}")
        return launcher.status()

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Any:
        body = launcher.metrics_exposition()
        if body is None:
            return _error(404, "GET /metrics: this node's metrics are on /metrics of the API port (docs/metrics.md)")
        return fastapi.Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


class AdminServer:
    """``build_app(launcher)`` served by uvicorn on a daemon thread.

    The socket is bound in the constructor, on the caller's thread, so a port in use fails the
    start (RuntimeError naming admin_port) instead of a log line from a background thread.
    """

    def __init__(self, launcher: Controlled, host: str, port: int):
        self.app = build_app(launcher)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise RuntimeError(f"admin_port: cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="afore-admin", daemon=True)

    def start(self) -> AdminServer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()
