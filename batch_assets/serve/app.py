"""The routes of `batch-assets serve`: OpenAI's Files and Batches API, with OpenAI's error bodies.

    POST /v1/files                 multipart `file` + `purpose=batch` (uploads.py)
    GET  /v1/files                 the files, newest first
    GET  /v1/files/{id}            a file object
    GET  /v1/files/{id}/content    its content
    DELETE /v1/files/{id}
    POST /v1/batches               {input_file_id, endpoint, completion_window: "24h", metadata}
    GET  /v1/batches               newest first, `after` and `limit` (1-100, default 20)
    GET  /v1/batches/{id}
    POST /v1/batches/{id}/cancel

With a key set (`SERVE_KEY_ENV`), every request must carry `Authorization: Bearer <key>` (the scheme
in any case; 401 otherwise); without one (loopback only), its `Host` must be a loopback name (400
otherwise), and a request a web page sends (an `Origin` other than the server's own,
`Sec-Fetch-Site` other than `same-origin` or `none`) is refused (403). New files and batches get
503 while the batch runner cannot go on; a failed write (a full disk) is OpenAI's error body with
507, never a bare 500. Every refusal is OpenAI's error body.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from batch_assets.serve.batch_runs import BatchRunner
from batch_assets.serve.objects import (
    FINISHED,
    CreateBatch,
    api_error,
    batch_object,
    create_problem,
    file_object,
    output_expiry,
    page,
)
from batch_assets.serve.settings import LOOPBACK_HOSTS, NO_ROOM, SERVE_KEY_ENV, UploadLimits
from batch_assets.serve.store import ServeStore, new_batch_id, new_file_id
from batch_assets.serve.uploads import UploadRefused, read_upload
from batch_assets.storage.errors import StorageError

logger = logging.getLogger(__name__)
# What a browser says of a request a page sent to its own origin, or a user typed: all a client sends.
_OWN_SITE = {"same-origin", "none"}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None, kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, api_error(message, code=code, param=param, kind=kind)


def _not_found(kind: str, given: str) -> ApiError:
    # The id is echoed as a repr, cut short: never a path, never anything read.
    return ApiError(404, f"no {kind} with id {given[:80]!r}", code="not_found")


def build_app(
    store: ServeStore, runner: BatchRunner, limits: UploadLimits, api_key: str | None, host: str = "127.0.0.1"
) -> FastAPI:
    """`host`: the address it is bound to (another loopback address than 127.0.0.1 is a Host name too)."""
    app = FastAPI(title="batch-assets serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    own_names = {*LOOPBACK_HOSTS, host.lower()}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None:
            if not hmac.compare_digest(_bearer_token(request).encode(), api_key.encode()):
                body = api_error(
                    f"missing or wrong API key: send `Authorization: Bearer <the value of {SERVE_KEY_ENV}>`",
                    code="invalid_api_key",
                )
                return JSONResponse(body, status_code=401)
        elif refusal := _foreign_host(request, own_names):
            return JSONResponse(api_error(refusal, code="invalid_host"), status_code=400)
        elif refusal := _cross_site(request):
            return JSONResponse(api_error(refusal, code="cross_site_request"), status_code=403)
        return await call_next(request)

    _add_file_routes(app, store, runner, limits)
    _add_batch_routes(app, store, runner)
    return app


def _bearer_token(request: Request) -> str:
    """The token of `Authorization: Bearer <token>`, the scheme in any case (RFC 9110 §11.1); else ""."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _foreign_host(request: Request, own_names: set[str]) -> str | None:
    """Why a keyless server refuses the request's `Host`, or None. Served to this machine only, a web
    page whose name an attacker resolves to 127.0.0.1 (DNS rebinding) could drive it from a browser;
    the browser sends the page's name as Host. Checked here rather than by Starlette's
    TrustedHostMiddleware, which answers in plain text: clients read OpenAI's error body."""
    given = request.headers.get("host", "")
    if _host_name(given) in own_names:
        return None
    return (
        f"Host {given[:100]!r} is not a name of this machine ({', '.join(LOOPBACK_HOSTS)}): a server "
        f"without a key ({SERVE_KEY_ENV}) answers only requests sent to this machine"
    )


def _host_name(host: str) -> str | None:
    """The name of a `Host` value (lower case, an IPv6 address without its brackets), or None when it
    is more than a name and a port."""
    try:
        parts = urlsplit(f"//{host}")
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return None
    return parts.hostname if parts.netloc == host and parts.username is None else None


def _cross_site(request: Request) -> str | None:
    """Why a keyless server refuses a request a web page sent, or None. A page the user visits may
    send a multipart upload to 127.0.0.1 with no CORS preflight (nor a readable answer: it needs
    none to fill the disk); the browser names the page in `Origin` and `Sec-Fetch-Site`, which a
    page cannot change. Clients (the openai SDK, curl) send neither."""
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin.lower() != own.lower():
        return (
            f"a request from the web page at {origin[:100]!r} is refused: "
            "this server has no key, so only this machine's clients may use it"
        )
    site = request.headers.get("sec-fetch-site")
    if site is not None and site.lower() not in _OWN_SITE:
        return (
            f"a request a browser sent from another site (Sec-Fetch-Site: {site[:20]!r}) is refused: "
            "this server has no key"
        )
    return None


def _storage_failure(exc: OSError | StorageError) -> JSONResponse:
    """A failed write as OpenAI's error body: 507 when there was no room (sent again at once, an
    upload would fail again: `x-should-retry: false` tells the openai SDK), else 500. The cause
    without the server's paths (the server's log has them)."""
    cause = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    if exc.errno in NO_ROOM:
        message = f"the server has no room to store it ({cause}); try again once room is made on the server"
        body = api_error(message, code="insufficient_storage", kind="server_error")
        return JSONResponse(body, status_code=507, headers={"x-should-retry": "false"})
    logger.warning("batch-assets serve: a request failed: %s", exc)
    return JSONResponse(api_error(f"the server failed ({cause})", code="server_error", kind="server_error"), 500)


def _refuse_new_work(runner: BatchRunner) -> None:
    if trouble := runner.trouble():
        raise ApiError(503, trouble, code="batch_runner_unavailable", kind="server_error")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OSError)
    async def os_errors(_request: Request, exc: OSError) -> JSONResponse:
        return _storage_failure(exc)

    @app.exception_handler(StorageError)
    async def storage_errors(_request: Request, exc: StorageError) -> JSONResponse:
        return _storage_failure(exc)

    @app.exception_handler(Exception)
    async def other_errors(_request: Request, exc: Exception) -> JSONResponse:
        # Still logged (Starlette raises it on); clients read OpenAI's error body, not a bare text 500.
        body = api_error(f"the server failed ({type(exc).__name__})", code="server_error", kind="server_error")
        return JSONResponse(body, status_code=500)

    @app.exception_handler(ApiError)
    async def api_errors(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(UploadRefused)
    async def refused_uploads(_request: Request, exc: UploadRefused) -> JSONResponse:
        return JSONResponse(api_error(exc.message, code=exc.code, param=exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_bodies(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return JSONResponse(api_error(f"{where}: {first.get('msg', 'invalid')}", param=where or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_errors(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(api_error(str(exc.detail), code=code), exc.status_code)


def _add_file_routes(app: FastAPI, store: ServeStore, runner: BatchRunner, limits: UploadLimits) -> None:
    @app.post("/v1/files")
    async def upload_file(request: Request) -> dict[str, Any]:
        _refuse_new_work(runner)
        # An expired file's bytes count no more. In a worker thread: it reads and deletes files (and
        # purges partitions), which must not hold up the event loop.
        await run_in_threadpool(runner.sweep_expired_files)
        staged = store.staging_path()
        upload = await read_upload(request, limits, staged, store.stored_bytes())
        expires_in = upload.expires_in or store.expiry_seconds
        obj = file_object(new_file_id(), upload.filename, upload.size, upload.purpose, expires_in=expires_in)
        return store.add_staged_file(staged, obj)

    @app.get("/v1/files")
    def list_files(purpose: str | None = None) -> dict[str, Any]:
        files = [f for f in store.list_files() if purpose is None or f["purpose"] == purpose]
        return {"object": "list", "data": files, "has_more": False}

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str) -> dict[str, Any]:
        found = store.file_object(file_id)
        if found is None:
            raise _not_found("file", file_id)
        return found

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> FileResponse:
        path = store.content_path(file_id) if store.file_object(file_id) is not None else None  # not expired
        if path is None:
            raise _not_found("file", file_id)
        return FileResponse(path, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        if not runner.forget_file(file_id):
            raise _not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _add_batch_routes(app: FastAPI, store: ServeStore, runner: BatchRunner) -> None:
    @app.post("/v1/batches")
    def create_batch(request: CreateBatch) -> dict[str, Any]:
        _refuse_new_work(runner)
        problem = create_problem(request)
        if problem:
            raise ApiError(400, problem[0], param=problem[1], code="invalid_value")
        input_file = store.file_object(request.input_file_id)
        if input_file is None:
            raise ApiError(400, f"no file with id {request.input_file_id[:80]!r}", param="input_file_id")
        if input_file["purpose"] != "batch":
            raise ApiError(400, "input_file_id must name a file uploaded with purpose 'batch'", param="input_file_id")
        task = runner.task_for(request.endpoint, store.content_path(request.input_file_id))
        # `created_at` is whole seconds (OpenAI's schema): batches made within one second are ordered
        # by `created_ns`, so they run and list in the order they were made.
        run = {
            "task": task,
            "started": False,
            "created_ns": time.time_ns(),
            "output_expiry_seconds": output_expiry(request),
        }
        record = {"batch": batch_object(new_batch_id(), request), "run": run}
        store.save_batch(record)
        runner.wake.set()
        return record["batch"]

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: int = Query(default=20, ge=1, le=100)) -> dict[str, Any]:
        batches = [record["batch"] for record in reversed(list(store.batch_records()))]
        return page(batches, after, limit)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str) -> dict[str, Any]:
        record = store.batch_record(batch_id)
        if record is None:
            raise _not_found("batch", batch_id)
        return record["batch"]

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        record = store.batch_record(batch_id)
        if record is None:
            raise _not_found("batch", batch_id)
        if record["batch"]["status"] in FINISHED:
            raise ApiError(400, f"cannot cancel a batch whose status is {record['batch']['status']}")
        cancelled = runner.cancel(batch_id)
        assert cancelled is not None
        return cancelled["batch"]
