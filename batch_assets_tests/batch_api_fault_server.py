"""A small real HTTP server that speaks OpenAI's Files and Batches API and fails on demand.

The faults a provider produces only by chance (a file refused at a line, a batch expiring with half
its results, an output file without some `custom_id`s, a restart while a run polls, a wrong key,
quota errors) are what the batch API engine must survive; a real provider (or OGX) cannot be made
to produce them in a test. This one is FastAPI under uvicorn on loopback, in a thread of the test
process, and answers every chat request with `Faults.answer` (the engine's handling is under test,
not a model). `stop()` and `start()` on the same port are a restart; its state (files, batches,
counts) lives in the object, as a provider's lives in its database.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

import uvicorn
from fastapi import FastAPI, File, Form, Header, HTTPException, UploadFile
from fastapi.responses import JSONResponse, Response

from batch_assets_tests.support import free_port


@dataclass
class Faults:
    answer: str = "positive"
    key: str | None = None  # the bearer key it takes (None: any)
    refuse_upload_line: int | None = None  # the first upload answers 400 naming this line
    fail_batch_line: int | None = None  # the first batch fails validation at this line
    finish: str = "completed"  # or "expired" (half the requests answered) or "cancelled"
    drop_last: int = 0  # a completed batch's output misses its last N custom_ids
    error_last: int = 0  # ... or answers them in the error file with HTTP 500
    polls_before_done: int = 1
    hold: bool = False  # batches stay in_progress until released
    quota: bool = False  # every upload answers 429
    lose_create_answer: bool = False  # the first batch create makes the batch, then answers 500
    window_seconds: int = 24 * 3600  # a batch's `expires_at` is its `created_at` plus this
    send_expires_at: bool = True  # else a batch has no `expires_at`, only `completion_window` ("<N>s")
    answered_when_cancelled: int = 0  # requests a cancelled batch's output file answers
    ignore_cancel: bool = False  # a cancel is counted and answered, but the batch goes on as it was
    cancel_slowly: bool = False  # a cancel answers "cancelling"; the next status read finds it cancelled
    # A completed batch's files contradicting themselves:
    twice: int = 0  # its first N answered requests answered twice in the output file ...
    twice_answer: str | None = None  # ... the second time with this content (None: the same again)
    also_error: int = 0  # its first N answered requests also listed in the error file (HTTP 500)
    unknown_ids: int = 0  # output lines answering custom_ids the batch never held
    unreadable_lines: int = 0  # output lines that are not JSON


@dataclass
class _Batch:
    id: str
    input_file_id: str
    created_at: int
    metadata: dict
    status: str = "validating"
    polls: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict | None = None
    counts: dict = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})


class FaultServer:
    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, _Batch] = {}
        self.batches_created = 0
        self.cancelled: list[str] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.app = self._app()

    # --- life cycle -------------------------------------------------------------------------------

    def start(self) -> FaultServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fault server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=20)
            self._server = None

    # --- the API ------------------------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI()

        def authorize(authorization: str | None) -> None:
            if self.faults.key is not None and authorization != f"Bearer {self.faults.key}":
                raise HTTPException(401, {"message": "Incorrect API key provided", "code": "invalid_api_key"})

        @app.exception_handler(HTTPException)
        async def error(_request, exc: HTTPException) -> JSONResponse:
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

        @app.post("/v1/files")
        def upload(
            file: Annotated[UploadFile, File()],
            purpose: Annotated[str, Form()],
            authorization: str | None = Header(None),
        ) -> dict:
            authorize(authorization)
            if self.faults.quota:
                raise HTTPException(429, {"message": "Enqueued token limit reached", "code": "rate_limit_exceeded"})
            if (line := self.faults.refuse_upload_line) is not None:
                self.faults.refuse_upload_line = None
                raise HTTPException(400, {"message": f"Invalid request on line {line}: body.messages is malformed"})
            file_id = f"file-{uuid.uuid4().hex[:12]}"
            self.files[file_id] = file.file.read()
            return _file(file_id, len(self.files[file_id]), purpose)

        @app.get("/v1/files/{file_id}/content")
        def content(file_id: str, authorization: str | None = Header(None)) -> Response:
            authorize(authorization)
            if file_id not in self.files:
                raise HTTPException(404, {"message": f"no file {file_id}"})
            return Response(self.files[file_id], media_type="application/jsonl")

        @app.post("/v1/batches")
        def create(body: dict, authorization: str | None = Header(None)) -> dict:
            authorize(authorization)
            if body.get("input_file_id") not in self.files:
                raise HTTPException(400, {"message": "unknown input_file_id"})
            with self._lock:
                self.batches_created += 1
                batch = _Batch(
                    f"batch_{uuid.uuid4().hex[:12]}",
                    body["input_file_id"],
                    int(time.time()),
                    body.get("metadata") or {},
                )
                self.batches[batch.id] = batch
            if self.faults.lose_create_answer:
                self.faults.lose_create_answer = False
                raise HTTPException(500, {"message": "The server had an error while processing your request"})
            return self._batch(batch)

        @app.get("/v1/batches")
        def listing(authorization: str | None = Header(None)) -> dict:
            authorize(authorization)
            data = [self._batch(b) for b in sorted(self.batches.values(), key=lambda b: -b.created_at)]
            return {"object": "list", "data": data, "has_more": False}

        @app.get("/v1/batches/{batch_id}")
        def retrieve(batch_id: str, authorization: str | None = Header(None)) -> dict:
            authorize(authorization)
            batch = self.batches[batch_id]
            with self._lock:
                batch.polls += 1
                if batch.status not in ("completed", "failed", "expired", "cancelled"):
                    self._advance(batch)
            return self._batch(batch)

        @app.post("/v1/batches/{batch_id}/cancel")
        def cancel(batch_id: str, authorization: str | None = Header(None)) -> dict:
            authorize(authorization)
            batch = self.batches[batch_id]
            self.cancelled.append(batch_id)
            if batch.status not in ("completed", "failed", "expired", "cancelled") and not self.faults.ignore_cancel:
                if self.faults.cancel_slowly:
                    batch.status = "cancelling"
                else:
                    self._finish(batch, "cancelled", answered=self.faults.answered_when_cancelled)
            return self._batch(batch)

        return app

    def _advance(self, batch: _Batch) -> None:
        if batch.status == "cancelling":
            self._finish(batch, "cancelled", answered=self.faults.answered_when_cancelled)
            return
        batch.status = "in_progress"
        if self.faults.hold or batch.polls < self.faults.polls_before_done:
            return
        lines = self.files[batch.input_file_id].splitlines()
        if (line := self.faults.fail_batch_line) is not None:
            self.faults.fail_batch_line = None
            batch.status = "failed"
            batch.errors = {
                "object": "list",
                "data": [{"code": "invalid_request", "line": line, "message": f"line {line}: invalid body"}],
            }
            return
        if self.faults.finish != "completed":
            self._finish(batch, self.faults.finish, answered=len(lines) // 2)
        else:
            self._finish(batch, "completed", answered=len(lines))

    def _finish(self, batch: _Batch, status: str, answered: int) -> None:
        requests = [json.loads(line) for line in self.files[batch.input_file_id].splitlines()]
        drop = self.faults.drop_last if status == "completed" else 0
        errors = self.faults.error_last if status == "completed" else 0
        answered_ids = requests[: max(0, answered - drop - errors)]
        errored = requests[max(0, answered - drop - errors) : max(0, answered - drop)]
        out = [_output_line(r, self.faults.answer) for r in answered_ids]
        err = [_error_line(r) for r in errored]
        odd: list[str] = []
        if status == "completed":
            out, err, odd = self._contradictions(answered_ids, out, err)
        if out or odd:
            batch.output_file_id = f"file-{uuid.uuid4().hex[:12]}"
            self.files[batch.output_file_id] = "".join([json.dumps(x) + "\n" for x in out] + odd).encode()
        if err:
            batch.error_file_id = f"file-{uuid.uuid4().hex[:12]}"
            self.files[batch.error_file_id] = "".join(json.dumps(x) + "\n" for x in err).encode()
        batch.status = status
        batch.counts = {"total": len(requests), "completed": len(out), "failed": len(err)}

    def _contradictions(self, answered: list[dict], out: list[dict], err: list[dict]) -> tuple[list, list, list]:
        """The output and error lines with the contradictions `faults` asks for added, and the
        unreadable lines (text) to append to the output file."""
        f = self.faults
        again = [_output_line(r, f.twice_answer or f.answer) for r in answered[: f.twice]]
        strangers = [_output_line({"custom_id": f"not-mine-{n}", "body": {}}, f.answer) for n in range(f.unknown_ids)]
        errors = [_error_line(r) for r in answered[: f.also_error]]
        garbage = [f'{{"custom_id": "cut off by a network error {n}\n' for n in range(f.unreadable_lines)]
        return out + again + strangers, err + errors, garbage

    def release(self) -> None:
        self.faults.hold = False

    def _batch(self, batch: _Batch) -> dict:
        window = self.faults.window_seconds
        return {
            "id": batch.id,
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": batch.input_file_id,
            "completion_window": "24h" if window == 24 * 3600 else f"{window}s",
            "status": batch.status,
            "created_at": batch.created_at,
            "expires_at": batch.created_at + window if self.faults.send_expires_at else None,
            "output_file_id": batch.output_file_id,
            "error_file_id": batch.error_file_id,
            "errors": batch.errors,
            "metadata": batch.metadata,
            "request_counts": batch.counts,
        }


def _file(file_id: str, size: int, purpose: str) -> dict:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": f"{file_id}.jsonl",
        "purpose": purpose,
        "status": "processed",
    }


def _output_line(request: dict, answer: str) -> dict:
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:8]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request["body"].get("model"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
    }
    return _line(request, 200, body)


def _error_line(request: dict) -> dict:
    body = {"error": {"message": "The server had an error while processing your request", "type": "server_error"}}
    return _line(request, 500, body)


def _line(request: dict, status: int, body: dict) -> dict:
    response = {"status_code": status, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:8]}",
        "custom_id": request["custom_id"],
        "response": response,
        "error": None,
    }
