"""The Batch API engine: a task's requests sent to a provider's OpenAI-compatible `/v1/batches`.

For `engine.kind: batch_api`: the provider (OpenAI, Together, Mistral, Groq, Azure OpenAI, OGX, ...)
runs the requests within `engine.completion_window` at a discount (`engine.batch_price_factor`).
The contract is the endpoint engine's (`OpenAIEngine`, whose settings, key handling and tokenizer
this one inherits); only `session.stream` differs, so the result cache, checkpoints, checks and
outputs are those of any engine, and only the requests they do not already hold reach the stream.

Per stream:
1. every request becomes a batch line whose `custom_id` is a hash of its body and request key
   (engines/batch_api_files.py);
2. requests a kept record already covers (`BatchRecords`, storage/batch_records.py: a batch this
   task submitted under the same settings, e.g. by a run killed while it waited) are collected
   from that batch, never submitted again;
3. the rest is cut into files of at most `max_requests_per_file` requests and `max_bytes_per_file`
   bytes, each uploaded (`purpose=batch`) and made a batch; the record is written before the
   upload, again with the file id, and again with the batch id, all before anything waits (a
   record with a file but no batch id is matched to the provider's batches by that file);
4. the batches are polled every `poll_seconds`; each finished one's output and error files are
   downloaded and matched by `custom_id` (contradictions settled and counted: `settle_answers`).
   Failed, expired or cancelled requests, and requests the files do not mention, become error
   rows, or are sent once more in a new batch when
   `resubmit_failed` is set; lines the provider refused by number (a failed batch's
   `errors.data[].line`, or a 400 naming a line) become error rows and the rest is sent again; a
   batch still unfinished at its `expires_at` plus `expiry_grace_seconds` is cancelled and
   collected as expired (never waited for forever);
5. a stop (Dagster's terminate or a signal inside a step: `DagsterExecutionInterruptedError`;
   Ctrl-C, SIGTERM: KeyboardInterrupt; SystemExit) cancels the batches in flight, whether it
   reaches the stream or its consumer; a re-run collects what they finished and sends the rest
   again. An ordinary failure cancels nothing: the retry collects the batches.
Records of a stream that ended are removed when the session closes (after the checkpoints are
written). Only chat tasks: embedding tasks use `engine.kind: openai`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import Field

from batch_assets.engines.batch_api_files import (
    Answer,
    AnswerCounts,
    RequestLine,
    chat_body,
    refused_lines,
    request_lines,
    settle_answers,
    split_files,
)
from batch_assets.engines.engine_figures import BatchTimes
from batch_assets.engines.openai_engine import (
    EndpointError,
    EndpointSettings,
    OpenAIEngine,
    _redact,
    chat_request_params,
    classify_failure,
)
from batch_assets.pipeline.engine_contract import Generation, Prompt, ResolvedSettings
from batch_assets.pipeline.openai_batch.protocol import CHAT_URL
from batch_assets.pipeline.result_stores import BatchRecords
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError
from batch_assets.pipeline.task_spec.batch_api import BATCH_API_KIND
from batch_assets.runtime.interrupts import Stopped, stop_requested

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# The batch's metadata key holding its record's name: how a batch is found again when the
# answer to its create was lost.
RECORD_METADATA = "batch_assets_record"
# A request is sent at most this many times (the first batch, and one more: `resubmit_failed`, or
# the rest of a file the provider refused for some of its lines).
MAX_ATTEMPTS = 2


class BatchApiError(EndpointError):
    """The batch API cannot serve this run (refused key, quota, unreachable); the message names the setting."""


@dataclass(frozen=True, kw_only=True)
class BatchApiSettings(EndpointSettings):
    # No defaults: `settings()` sets each from the task's `engine:` (task_spec/engine.py has them).
    completion_window: str
    poll_seconds: float
    max_requests_per_file: int
    max_bytes_per_file: int
    resubmit_failed: bool
    expiry_grace_seconds: float

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "engine": BATCH_API_KIND}


class BatchApiEngine(OpenAIEngine):
    """Sends prompts as batches to an OpenAI-compatible Batch API (`/v1/files` + `/v1/batches`).

    Unset fields fall back to each task's `engine:` settings; set `api_key` with `dg.EnvVar("NAME")`.
    """

    poll_seconds: float | None = Field(default=None, description="Seconds between status checks of a batch.")

    def resolve(self, task: TaskSpec) -> ResolvedSettings:
        if task.output.pooling:
            raise TaskSpecError(
                f"task {task.name!r}: engine.kind batch_api sends chat requests; an embedding or similarity "
                "task uses engine.kind openai (its /v1/embeddings) or vllm"
            )
        return replace(super().resolve(task), kind=BATCH_API_KIND)

    def settings(self, task: TaskSpec, *, offline: bool = False) -> BatchApiSettings:
        base = super().settings(task, offline=offline)
        spec = task.engine
        return BatchApiSettings(
            **{f.name: getattr(base, f.name) for f in fields(base) if f.name != "kind"},
            kind=BATCH_API_KIND,
            completion_window=spec.completion_window,
            poll_seconds=spec.poll_seconds if self.poll_seconds is None else self.poll_seconds,
            max_requests_per_file=spec.max_requests_per_file,
            max_bytes_per_file=spec.max_bytes_per_file,
            resubmit_failed=spec.resubmit_failed,
            expiry_grace_seconds=spec.expiry_grace_seconds,
        )

    # The contract's `Engine.session` (pipeline/engine_contract.py), not the endpoint's: another session type.
    @contextlib.contextmanager
    def session(  # type: ignore[override]
        self,
        task: TaskSpec,
        settings: BatchApiSettings,
        log: Callable[[str], None] = lambda message: None,
        records: BatchRecords | None = None,
    ) -> Iterator[BatchSession]:
        """`records`: where the batches are kept (storage/batch_records.py); required to submit any."""
        session = BatchSession(self, task, settings, log, records)
        try:
            yield session
        except BaseException as stop:
            # A stop that reached the stream's consumer rather than the stream (between two results):
            # the stream's own handler never saw it.
            if _is_stop(stop):
                try:
                    session.cancel_in_flight()
                except Exception as exc:  # noqa: BLE001 - the stop goes on; a failed cancel must not turn it into a failure
                    log(f"could not cancel the batches in flight ({exc}); a re-run adopts them")
            raise
        session.forget_collected()  # only after a stream that ended: its results are checkpointed


@dataclass
class _Stream:
    """One stream's requests and what is left of them."""

    lines: dict[str, RequestLine]  # by custom_id, in the stream's order
    positions: dict[str, int]
    left: set[str]  # not answered yet
    attempts: dict[str, int] = field(default_factory=dict)
    # The requests that asked for their tokens' log-probabilities (an OpenAI batch line's `logprobs`);
    # the others' answers keep only their sum (a label's confidence).
    asked_logprobs: set[str] = field(default_factory=set)


class BatchSession:
    """A batch API needs no start: `started_here` is always False."""

    started_here = False
    start_seconds = 0.0

    def __init__(
        self,
        engine: BatchApiEngine,
        task: TaskSpec,
        settings: BatchApiSettings,
        log: Callable[[str], None],
        records: BatchRecords | None,
    ) -> None:
        self.engine, self.task, self.settings, self.log, self.records = engine, task, settings, log, records
        self.batch_ids: list[str] = []
        self._collected: dict[str, dict] = {}  # records whose batch this session collected, by name
        self._wanted: set[str] = set()
        self._runs: list[_Run] = []  # the streams not ended yet: what a stop must cancel
        self.answer_counts = AnswerCounts()  # over every batch collected: what did not add up
        self.times = BatchTimes()  # the provider's own clock of each batch collected

    def start(self, requests: int = 0) -> None:
        pass

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "engine_started_by_this_run": False,
            "batch_ids": ", ".join(self.batch_ids),
            **self.answer_counts.metadata(),
            **self.times.metadata(),
        }

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:

        if self.records is None:
            raise BatchApiError("a batch API session needs somewhere to keep its batch ids (`records`)")
        prompts = list(prompts)
        if any(p.messages is None for p in prompts):
            raise TypeError("the batch API engine sends each prompt's messages: build prompts with prompt_encoders")
        lines = request_lines([chat_body(p, self._params(p)) for p in prompts], keys=[p.key for p in prompts])
        state = _Stream(
            lines={line.custom_id: line for line in lines},
            positions={line.custom_id: position for position, line in enumerate(lines)},
            left={line.custom_id for line in lines},
            asked_logprobs={
                line.custom_id
                for line, prompt in zip(lines, prompts, strict=True)
                if getattr(prompt.sampling, "logprobs", None) is not None
            },
        )
        self._wanted |= state.left
        with self._client() as client:
            run = _Run(self, client, state)
            # Kept while the stream may have batches in flight: also when its consumer stops
            # between two results and the stream is closed before the stop reaches the session.
            self._runs.append(run)
            yield from run.run()
            self._runs.remove(run)

    def _client(self):
        import openai

        s = self.settings
        return openai.OpenAI(
            base_url=s.base_url,
            api_key=self.engine._api_key(self.task),
            timeout=s.request_timeout_s,
            max_retries=s.max_retries,
        )

    def _params(self, prompt: Prompt) -> dict:
        s = self.settings
        return chat_request_params(self.task, s.model, s.structured_outputs, prompt.sampling, prompt.output, s.logprobs)

    def cancel_in_flight(self) -> None:
        """Cancel the batches of every stream not ended yet (the run was stopped), with a client of
        its own: a stream closed by the stop has closed its client."""
        if not any(run.in_flight for run in self._runs):
            return
        with self._client() as client:
            for run in self._runs:
                run.cancel_in_flight(client)

    def forget_collected(self) -> None:
        """Remove the records of batches collected whole by this session's streams."""
        if self.records is None:
            return
        for name, record in self._collected.items():
            if set(record["ids"]) <= self._wanted:
                self.records.remove(name)


class _Run:
    """Submit, wait, collect: one stream through the batch API."""

    def __init__(self, session: BatchSession, client, state: _Stream) -> None:
        self.session, self.client, self.state = session, client, state
        self.settings = session.settings
        self.records: BatchRecords = session.records  # type: ignore[assignment]  # stream() checked it
        self.in_flight: list[dict] = []

    def run(self) -> Iterator[tuple[int, Generation]]:
        try:
            self._adopt()
            fresh = [self.state.lines[i] for i in self.state.lines if i in self.state.left and not self._covered(i)]
            yield from self._answer(self._submit(fresh, attempt=1))
            while self.in_flight:
                for record, batch in self._wait():
                    self.in_flight.remove(record)
                    yield from self._answer(self._collect(record, batch))
        except BaseException as stop:
            if _is_stop(stop):
                self.cancel_in_flight()
            raise
        if self.state.left:
            raise BatchApiError(f"{len(self.state.left)} requests were neither answered nor failed by the batch API")

    def _save(self, record: dict) -> None:
        self.records.save({key: value for key, value in record.items() if key != "id_set"})

    def _covered(self, custom_id: str) -> bool:
        return any(custom_id in record["id_set"] for record in self.in_flight)

    def _answer(self, answers: dict[str, Answer]) -> Iterator[tuple[int, Generation]]:
        for custom_id, answer in answers.items():
            if custom_id not in self.state.left:
                continue
            self.state.left.discard(custom_id)
            generation = answer.generation or Generation(
                text=None, finish_reason=None, num_prompt_tokens=0, num_generated_tokens=0, error=answer.error
            )
            if custom_id not in self.state.asked_logprobs:
                generation = replace(generation, token_logprobs=None)
            yield self.state.positions[custom_id], generation

    # --- records kept by an earlier run ------------------------------------------------------------

    def _adopt(self) -> None:
        """Batches of kept records that hold requests of this stream: waited for (or, for a record
        that never got its batch, the batch made now), never submitted again."""
        newest: dict[str, dict] = {}
        for record in self.records.load():
            for custom_id in record["ids"]:
                if custom_id in self.state.left:
                    newest[custom_id] = record  # load() is oldest first: a resubmission wins
        for record in {r["name"]: r for r in newest.values()}.values():
            ids = [i for i, r in newest.items() if r is record]
            for custom_id in ids:
                self.state.attempts[custom_id] = record.get("attempt", 1)
            if not record.get("input_file_id"):  # killed while uploading: nothing was submitted
                self.records.remove(record["name"])
                continue
            if not record.get("batch_id"):
                record["batch_id"] = self._batch_made_from(record) or self._create_batch(record)
                self._save(record)
            elif self._nothing_to_collect(record):
                self.records.remove(record["name"])
                for custom_id in ids:
                    self.state.attempts.pop(custom_id, None)
                continue
            self.session.log(
                f"collecting batch {record['batch_id']} submitted before ({len(ids)} requests of this run)"
            )
            self._track(record)

    def _nothing_to_collect(self, record: dict) -> bool:
        """A kept batch that ended without answering anything (failed as a whole, cancelled or
        expired with no output or error file): its requests are sent again as fresh ones, so a
        batch failed for good never fails every later run (and Dagster's retry) again."""
        try:
            batch = self._call("read the batch's status", self.client.batches.retrieve, record["batch_id"])
        except BatchApiError:
            return False  # unreachable now: waited for as any batch in flight (polls retried)
        ended = batch.status in ("failed", "cancelled", "expired")
        if ended and not batch.output_file_id and not batch.error_file_id:
            self.session.log(f"batch {batch.id} submitted before ended {batch.status} with no results: sending again")
            return True
        return False

    def _batch_made_from(self, record: dict) -> str | None:
        """The provider's batch of this record (its `batch_assets_record` metadata, or its file), when
        one was made before the run was killed or before a create's answer was lost."""
        import openai

        try:
            for batch in self._call("list batches", self.client.batches.list, limit=100):
                made_here = (batch.metadata or {}).get(RECORD_METADATA) == record["name"]
                if made_here or batch.input_file_id == record["input_file_id"]:
                    return batch.id
                if batch.created_at < record["created"] - 3600:
                    break
        except openai.APIError as exc:  # raised by a later page than the first
            raise self._failure("list batches", exc) from None
        return None

    def _track(self, record: dict) -> None:
        record["id_set"] = set(record["ids"])
        self.in_flight.append(record)
        self.session.batch_ids.append(record["batch_id"])

    # --- submitting ---------------------------------------------------------------------------------

    def _submit(self, lines: list[RequestLine], attempt: int) -> dict[str, Answer]:
        """`lines` uploaded and made batches; returns the error rows of lines the provider refused."""
        answers: dict[str, Answer] = {}
        try:
            files = list(split_files(lines, self.settings.max_requests_per_file, self.settings.max_bytes_per_file))
        except ValueError as exc:
            raise BatchApiError(f"task {self.session.task.name!r}: {exc}") from None
        for chunk in files:
            for line in chunk:
                self.state.attempts[line.custom_id] = attempt
            answers |= self._submit_file(chunk, attempt)
        return answers

    def _submit_file(self, chunk: list[RequestLine], attempt: int) -> dict[str, Answer]:

        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        record = {"name": name, "created": int(time.time()), "attempt": attempt, "ids": [x.custom_id for x in chunk]}
        self._save(record)  # before the upload: a kill from here on is found again
        data = b"".join(line.line for line in chunk)
        try:
            uploaded = self._call("upload the batch file", self._upload, name, data)
            record["input_file_id"] = uploaded.id
            self._save(record)
            record["batch_id"] = self._create_batch(record)
        except _Refused as refused:
            self.records.remove(name)
            return self._refused(chunk, refused, attempt)
        self._save(record)
        self.session.log(
            f"submitted batch {record['batch_id']}: {len(chunk)} requests, {len(data):,} bytes "
            f"(file {record['input_file_id']}, window {self.settings.completion_window})"
        )
        self._track(record)
        return {}

    def _upload(self, name: str, data: bytes):
        return self.client.files.create(file=(f"{name}.jsonl", data, "application/jsonl"), purpose="batch")

    def _create_batch(self, record: dict) -> str:
        """The batch of the record's file. Not the client's retries: a create that reached the
        server but whose answer was lost (a timeout, a 5xx) made a batch already, so before it is
        sent again the provider's batches are searched for this record's."""
        import openai

        client = self.client.with_options(max_retries=0)
        for attempt in range(self.settings.max_retries + 1):
            try:
                batch = client.batches.create(
                    input_file_id=record["input_file_id"],
                    endpoint=CHAT_URL,
                    completion_window=self.settings.completion_window,
                    metadata={RECORD_METADATA: record["name"]},
                )
                return batch.id
            except (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError) as exc:
                if not isinstance(exc, openai.RateLimitError):  # a 429 made no batch
                    with contextlib.suppress(BatchApiError):
                        if found := self._batch_made_from(record):
                            return found
                if attempt == self.settings.max_retries:
                    raise self._failure("create the batch", exc) from None
                self._sleep(min(0.5 * 2**attempt, 8.0))
            except openai.APIError as exc:
                raise self._failure("create the batch", exc) from None
        raise AssertionError("unreachable")  # the loop returns or raises

    def _refused(self, chunk: list[RequestLine], refused: _Refused, attempt: int) -> dict[str, Answer]:
        """A file the provider refused for lines it named: those are error rows, the rest is sent again
        (once); refused without a line number: the run fails with the provider's words."""
        at_fault = {n for n in refused.lines if n <= len(chunk)}
        if not at_fault or attempt >= MAX_ATTEMPTS:
            raise BatchApiError(refused.message)
        answers = {
            chunk[n - 1].custom_id: Answer(error=f"batch_refused: line {n} of the batch file: {refused.detail}"[:300])
            for n in sorted(at_fault)
        }
        rest = [line for n, line in enumerate(chunk, start=1) if n not in at_fault]
        self.session.log(
            f"the batch API refused lines {sorted(at_fault)[:10]} of a file; sending the other {len(rest)}"
        )
        return answers | (self._submit(rest, attempt + 1) if rest else {})

    def _call(self, action: str, function: Callable, *args, **kwargs):
        """A client call; a refusal of the whole run (key, quota, server) raises `BatchApiError`
        naming the setting, a 400 that names lines raises `_Refused`."""
        import openai

        try:
            return function(*args, **kwargs)
        except openai.APIError as exc:
            raise self._failure(action, exc) from None

    def _failure(self, action: str, exc) -> Exception:
        import openai

        s, key = self.settings, self.session.engine._api_key(self.session.task)
        where = f"{s.base_url} (task {self.session.task.name!r})"
        status = getattr(exc, "status_code", None)
        detail = _redact(str(getattr(exc, "message", exc)), key)[:300]
        if status == 400 and (lines := refused_lines(None, detail)):
            return _Refused(lines, detail, f"the batch API at {where} refused to {action}: {detail}")
        if status == 429:
            return BatchApiError(
                f"the batch API at {where} refused to {action} with HTTP 429 after {s.max_retries + 1} attempts "
                f"({detail}): a rate limit or the provider's batch quota (enqueued tokens). Nothing more was "
                "submitted and kept batches stay kept: re-run later, raise `engine.max_retries`, or lower "
                "`engine.max_requests_per_file`"
            )
        if isinstance(exc, openai.APIStatusError) and status not in (401, 403, 404):
            return BatchApiError(
                f"the batch API at {where} refused to {action} with HTTP {status}: {detail}. Check "
                "`engine.model` and the request settings (and `engine.max_bytes_per_file` for a file too large)"
            )
        failure = classify_failure(
            exc,
            base_url=s.base_url,
            model=s.model,
            timeout_s=s.request_timeout_s,
            max_retries=s.max_retries,
            api_key=key,
        )
        return BatchApiError(f"cannot {action}: {failure.fatal or failure.error}")

    # --- waiting and collecting ----------------------------------------------------------------------

    def _wait(self) -> list[tuple[dict, Any]]:
        """The batches in flight that have finished, polling every `poll_seconds` until one has. A
        server that cannot be reached is asked again at the next poll; after `max_retries + 1`
        polls in a row the run fails (the batch ids are kept: a re-run collects them)."""
        failed_polls, last_seen = 0, dict[str, tuple]()
        while True:
            finished = []
            try:
                for record in self.in_flight:
                    batch = self._call("read the batch's status", self.client.batches.retrieve, record["batch_id"])
                    self._report(record, batch, last_seen)
                    batch = self._past_window(record, batch)
                    if batch.status in TERMINAL:
                        finished.append((record, batch))
                failed_polls = 0
            except BatchApiError as exc:
                failed_polls += 1
                if failed_polls > self.settings.max_retries:
                    raise BatchApiError(
                        f"{exc} (while waiting; the batch ids are kept: re-run to collect them)"
                    ) from None
                log.warning("polling the batch API failed (%d in a row): %s", failed_polls, exc)
            if finished:
                return finished
            self._sleep(self.settings.poll_seconds)

    def _past_window(self, record: dict, batch):
        """A batch the provider has not ended by its `expires_at` plus `expiry_grace_seconds`: the run
        cancels it (a provider that never ends it would hold the run, its slot and its pool for good)
        and, once the cancel has landed or had the grace period too, collects it as expired: its
        answers kept, the rest `batch_expired` error rows. Before that, `batch` as it is."""
        grace = self.settings.expiry_grace_seconds
        expires = record.get("past_window") or _expires_at(batch, self.settings.completion_window)
        now = time.time()
        if not record.get("past_window"):
            if batch.status in TERMINAL or now < expires + grace:
                return batch
            self.session.log(
                f"batch {batch.id}: still {batch.status} {now - expires:.0f} s after its window ended "
                f"(engine.expiry_grace_seconds: {grace:g}); cancelling it"
            )
            with contextlib.suppress(BatchApiError):  # not reached now: the next poll tells
                batch = self._call("cancel the batch", self.client.batches.cancel, batch.id)
            record["past_window"] = expires
            self._save(record)
        # Cancelled as asked (at once, or "cancelling" first), or never: expired either way. A batch
        # that completed or failed meanwhile is collected as such.
        if batch.status in ("cancelled", "expired") or (batch.status not in TERMINAL and now >= expires + 2 * grace):
            return _Expired(batch.id, batch.output_file_id, batch.error_file_id, expires)
        return batch

    def _report(self, record: dict, batch, last_seen: dict) -> None:
        counts = batch.request_counts
        seen = (batch.status, counts.completed if counts else None, counts.failed if counts else None)
        if last_seen.get(record["batch_id"]) != seen:
            last_seen[record["batch_id"]] = seen
            done = f", {counts.completed}/{counts.total} done, {counts.failed} failed" if counts else ""
            self.session.log(f"batch {record['batch_id']}: {batch.status}{done}")

    @staticmethod
    def _sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if stop_requested():
                raise Stopped()
            time.sleep(min(left, 0.5))

    def _collect(self, record: dict, batch) -> dict[str, Answer]:
        """A finished batch's answers for this stream's requests; what it left unanswered (and its
        failures, with `resubmit_failed`) sent once more."""
        files = [
            self._call("download the batch's results", self.client.files.content, file_id).content
            for file_id in (batch.output_file_id, batch.error_file_id)
            if file_id
        ]
        counts = AnswerCounts()
        answers = settle_answers(files, record["id_set"], counts)
        self.session.answer_counts.add(counts)
        self.session.times.add(batch)
        if said := counts.summary():
            self.session.log(f"batch {batch.id}: its output and error files do not add up ({said})")
        self.session._collected[record["name"]] = record
        if batch.status == "failed":
            return self._failed_batch(record, batch, answers)
        unanswered = [i for i in record["ids"] if i in self.state.left and i not in answers]
        retry = [i for i in record["ids"] if i in self.state.left and self._may_resend(i, answers.get(i), record)]
        for custom_id in unanswered:
            if custom_id not in retry:
                answers[custom_id] = Answer(error=_unanswered(batch))
        if retry:
            self.session.log(f"batch {batch.id} ({batch.status}): sending {len(retry)} requests again in a new batch")
            answers = {i: a for i, a in answers.items() if i not in retry}
            answers |= self._submit([self.state.lines[i] for i in retry], self.state.attempts.get(retry[0], 1) + 1)
        return answers

    def _may_resend(self, custom_id: str, answer: Answer | None, record: dict) -> bool:
        if self.state.attempts.get(custom_id, 1) >= MAX_ATTEMPTS:
            return False
        if record.get("cancelled_by_run") and answer is None:
            return True  # this task's own interrupt stopped it: a re-run asks again
        return self.settings.resubmit_failed and (answer is None or (answer.error is not None and answer.retryable))

    def _failed_batch(self, record: dict, batch, answers: dict[str, Answer]) -> dict[str, Answer]:
        """A batch that failed as a whole (its file refused): the lines it names are error rows and
        the others are sent again; without line numbers the run fails with the provider's words."""
        errors = getattr(batch, "errors", None)
        messages = "; ".join(str(getattr(e, "message", e)) for e in (getattr(errors, "data", None) or []))[:300]
        lines = refused_lines(errors, messages)
        chunk = [self.state.lines[i] for i in record["ids"] if i in self.state.lines]
        if len(chunk) != len(record["ids"]):  # a batch of another run's requests: ids by line unknown here
            lines = set()
        refused = _Refused(
            lines,
            messages or "no detail",
            f"batch {batch.id} at {self.settings.base_url} failed as a whole: {messages or 'no detail'}. Check "
            "`engine.model` and the request settings (`engine.max_requests_per_file` for a quota per batch)",
        )
        try:
            attempt = self.state.attempts.get(chunk[0].custom_id, 1) if chunk else 1
            return answers | self._refused(chunk, refused, attempt)
        except BatchApiError:
            self.records.remove(record["name"])  # the run fails; the next one must not adopt this batch
            raise

    def cancel_in_flight(self, client=None) -> None:
        """Cancel the batches in flight, each once (a stop is seen by the stream and by its session):
        the provider stops billing for them; their records stay, marked, so a re-run collects what
        they finished and asks again for the rest."""
        cancelling, self.in_flight = self.in_flight, []
        for record in cancelling:
            with contextlib.suppress(Exception):  # best effort: the stop goes on whatever the provider says
                (client or self.client).with_options(max_retries=0, timeout=10).batches.cancel(record["batch_id"])
                record["cancelled_by_run"] = True
                self._save(record)
                self.session.log(f"cancelled batch {record['batch_id']} (interrupted)")


def _is_stop(error: BaseException) -> bool:
    """Whether `error` stops the run: Dagster's terminate inside a step (its
    `DagsterExecutionInterruptedError`, raised from the polling sleep), Ctrl-C and SIGTERM
    (KeyboardInterrupt, runtime/interrupts.py), SystemExit. Not an ordinary failure, whose batches
    are kept for the retry to collect, nor a consumer that closed the stream (GeneratorExit)."""
    return not isinstance(error, Exception | GeneratorExit)


class _Refused(Exception):
    def __init__(self, lines: set[int], detail: str, message: str) -> None:
        super().__init__(message)
        self.lines, self.detail, self.message = lines, detail, message


@dataclass(frozen=True)
class _Expired:
    """A batch the run gave up on past its window (`_Run._past_window`), collected as expired: with
    the files the provider gave it, if any."""

    id: str
    output_file_id: str | None
    error_file_id: str | None
    expires_at: float
    status: str = "expired"


# A completion window as providers write it: "24h", "7d", "30m".
_WINDOW = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _expires_at(batch, completion_window: str) -> float:
    """When the provider's window for `batch` ends: its `expires_at`, else its `created_at` plus its
    completion window (the task's when the provider names none it can read)."""
    if getattr(batch, "expires_at", None):
        return float(batch.expires_at)
    match = _WINDOW.match(getattr(batch, "completion_window", None) or "") or _WINDOW.match(completion_window)
    window = int(match[1]) * _UNIT_SECONDS[match[2]] if match else 24 * 3600
    return float(batch.created_at) + window


def _unanswered(batch) -> str:
    if isinstance(batch, _Expired):
        ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(batch.expires_at))
        return (
            f"batch_expired: batch {batch.id} was not finished by the end of its window ({ended}) plus "
            "engine.expiry_grace_seconds; the run cancelled it before this request was run"
        )
    if batch.status in ("expired", "cancelled"):
        return f"batch_{batch.status}: batch {batch.id} {batch.status} before this request was run"
    return f"batch_missing: batch {batch.id} completed without an output or error line for this request"
