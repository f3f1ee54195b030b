"""One stream of a task's requests through a provider's Batch API: submit, wait, collect.

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
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from batch_assets.engines.batch_api_failures import (
    BatchApiError,
    Expired,
    Refused,
    batch_api_failure,
    expires_at,
    is_stop,
    unanswered_error,
)
from batch_assets.engines.batch_api_files import (
    Answer,
    AnswerCounts,
    RequestLine,
    refused_lines,
    settle_answers,
    split_files,
)
from batch_assets.engines.endpoint_client import EndpointSettings
from batch_assets.engines.engine_figures import BatchTimes
from batch_assets.pipeline.engine_contract import Generation
from batch_assets.pipeline.openai_batch.protocol import CHAT_URL
from batch_assets.pipeline.result_stores import BatchRecords
from batch_assets.pipeline.task_spec import TaskSpec
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


@dataclass(frozen=True, kw_only=True)
class BatchApiSettings(EndpointSettings):
    # No defaults: `BatchApiEngine.settings` sets each from the task's `engine:` (task_spec/engine.py has them).
    completion_window: str
    poll_seconds: float
    max_requests_per_file: int
    max_bytes_per_file: int
    resubmit_failed: bool
    expiry_grace_seconds: float

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "engine": BATCH_API_KIND}


@dataclass
class StreamState:
    """One stream's requests and what is left of them."""

    lines: dict[str, RequestLine]  # by custom_id, in the stream's order
    positions: dict[str, int]
    left: set[str]  # not answered yet
    attempts: dict[str, int] = field(default_factory=dict)
    # The requests that asked for their tokens' log-probabilities (an OpenAI batch line's `logprobs`);
    # the others' answers keep only their sum (a label's confidence).
    asked_logprobs: set[str] = field(default_factory=set)


@dataclass
class SessionShare:
    """What the streams of one session share: the task, its settings and log, and what they
    submitted and collected (the session's metadata; the records it removes at its end)."""

    task: TaskSpec
    settings: BatchApiSettings
    log: Callable[[str], None]
    batch_ids: list[str] = field(default_factory=list)
    collected: dict[str, dict] = field(default_factory=dict)  # records whose batch was collected, by name
    answer_counts: AnswerCounts = field(default_factory=AnswerCounts)  # over every batch: what did not add up
    times: BatchTimes = field(default_factory=BatchTimes)  # the provider's own clock of each batch collected


class BatchRun:
    """Submit, wait, collect: one stream through the batch API."""

    def __init__(self, share: SessionShare, records: BatchRecords, client, api_key: str, state: StreamState) -> None:
        self.share, self.records, self.client, self.state = share, records, client, state
        self.settings = share.settings
        self.api_key = api_key  # only to keep it out of messages: the client holds it
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
            if is_stop(stop):
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
            self.share.log(f"collecting batch {record['batch_id']} submitted before ({len(ids)} requests of this run)")
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
            self.share.log(f"batch {batch.id} submitted before ended {batch.status} with no results: sending again")
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
        self.share.batch_ids.append(record["batch_id"])

    # --- submitting ---------------------------------------------------------------------------------

    def _submit(self, lines: list[RequestLine], attempt: int) -> dict[str, Answer]:
        """`lines` uploaded and made batches; returns the error rows of lines the provider refused."""
        answers: dict[str, Answer] = {}
        try:
            files = list(split_files(lines, self.settings.max_requests_per_file, self.settings.max_bytes_per_file))
        except ValueError as exc:
            raise BatchApiError(f"task {self.share.task.name!r}: {exc}") from None
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
        except Refused as refused:
            self.records.remove(name)
            return self._refused(chunk, refused, attempt)
        self._save(record)
        self.share.log(
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

    def _refused(self, chunk: list[RequestLine], refused: Refused, attempt: int) -> dict[str, Answer]:
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
        self.share.log(f"the batch API refused lines {sorted(at_fault)[:10]} of a file; sending the other {len(rest)}")
        return answers | (self._submit(rest, attempt + 1) if rest else {})

    def _call(self, action: str, function: Callable, *args, **kwargs):
        """A client call; a refusal of the whole run (key, quota, server) raises `BatchApiError`
        naming the setting, a 400 that names lines raises `Refused`."""
        import openai

        try:
            return function(*args, **kwargs)
        except openai.APIError as exc:
            raise self._failure(action, exc) from None

    def _failure(self, action: str, exc) -> Exception:
        return batch_api_failure(action, exc, self.settings, self.share.task.name, self.api_key)

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
        expires = record.get("past_window") or expires_at(batch, self.settings.completion_window)
        now = time.time()
        if not record.get("past_window"):
            if batch.status in TERMINAL or now < expires + grace:
                return batch
            self.share.log(
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
            return Expired(batch.id, batch.output_file_id, batch.error_file_id, expires)
        return batch

    def _report(self, record: dict, batch, last_seen: dict) -> None:
        counts = batch.request_counts
        seen = (batch.status, counts.completed if counts else None, counts.failed if counts else None)
        if last_seen.get(record["batch_id"]) != seen:
            last_seen[record["batch_id"]] = seen
            done = f", {counts.completed}/{counts.total} done, {counts.failed} failed" if counts else ""
            self.share.log(f"batch {record['batch_id']}: {batch.status}{done}")

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
        self.share.answer_counts.add(counts)
        self.share.times.add(batch)
        if said := counts.summary():
            self.share.log(f"batch {batch.id}: its output and error files do not add up ({said})")
        self.share.collected[record["name"]] = record
        if batch.status == "failed":
            return self._failed_batch(record, batch, answers)
        unanswered = [i for i in record["ids"] if i in self.state.left and i not in answers]
        retry = [i for i in record["ids"] if i in self.state.left and self._may_resend(i, answers.get(i), record)]
        for custom_id in unanswered:
            if custom_id not in retry:
                answers[custom_id] = Answer(error=unanswered_error(batch))
        if retry:
            self.share.log(f"batch {batch.id} ({batch.status}): sending {len(retry)} requests again in a new batch")
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
        refused = Refused(
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
                self.share.log(f"cancelled batch {record['batch_id']} (interrupted)")
