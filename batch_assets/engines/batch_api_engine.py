"""The Batch API engine: a task's requests sent to a provider's OpenAI-compatible `/v1/batches`.

For `engine.kind: batch_api`: the provider (OpenAI, Together, Mistral, Groq, Azure OpenAI, OGX, ...)
runs the requests within `engine.completion_window` at a discount (`engine.batch_price_factor`).
The contract is the endpoint engine's (`OpenAIEngine`, whose settings, key handling and tokenizer
this one inherits); only `session.stream` differs, so the result cache, checkpoints, checks and
outputs are those of any engine, and only the requests they do not already hold reach the stream.

Each stream's requests are submitted, waited for and collected by batch_api_run.py (`BatchRun`),
which keeps each batch's record (`BatchRecords`, storage/batch_records.py) before anything waits, so
a re-run collects what an earlier one submitted instead of submitting it again; a stop cancels the
batches in flight. Records of a stream that ended are removed when the session closes (after the
checkpoints are written). Only chat tasks: embedding tasks use `engine.kind: openai`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, replace
from typing import Any

from pydantic import Field

from batch_assets.engines.batch_api_failures import BatchApiError, is_stop
from batch_assets.engines.batch_api_files import chat_body, request_lines
from batch_assets.engines.batch_api_run import BatchApiSettings, BatchRun, SessionShare, StreamState
from batch_assets.engines.endpoint_requests import chat_request_params
from batch_assets.engines.openai_engine import OpenAIEngine
from batch_assets.pipeline.engine_contract import Generation, Prompt, ResolvedSettings
from batch_assets.pipeline.result_stores import BatchRecords
from batch_assets.pipeline.task_spec import TaskSpec, TaskSpecError
from batch_assets.pipeline.task_spec.batch_api import BATCH_API_KIND


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
            if is_stop(stop):
                try:
                    session.cancel_in_flight()
                except Exception as exc:  # noqa: BLE001 - the stop goes on; a failed cancel must not turn it into a failure
                    log(f"could not cancel the batches in flight ({exc}); a re-run adopts them")
            raise
        session.forget_collected()  # only after a stream that ended: its results are checkpointed


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
        # What its streams share: the batch ids they submitted, the records they collected, the counts.
        self.share = SessionShare(task, settings, log)
        self._wanted: set[str] = set()
        self._runs: list[BatchRun] = []  # the streams not ended yet: what a stop must cancel

    def start(self, requests: int = 0) -> None:
        pass

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "engine_started_by_this_run": False,
            "batch_ids": ", ".join(self.share.batch_ids),
            **self.share.answer_counts.metadata(),
            **self.share.times.metadata(),
        }

    def stream(self, prompts: Iterable[Prompt]) -> Iterator[tuple[int, Generation]]:

        if self.records is None:
            raise BatchApiError("a batch API session needs somewhere to keep its batch ids (`records`)")
        prompts = list(prompts)
        if any(p.messages is None for p in prompts):
            raise TypeError("the batch API engine sends each prompt's messages: build prompts with prompt_encoders")
        lines = request_lines([chat_body(p, self._params(p)) for p in prompts], keys=[p.key for p in prompts])
        state = StreamState(
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
            run = BatchRun(self.share, self.records, client, self.engine.api_key_for(self.task), state)
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
            api_key=self.engine.api_key_for(self.task),
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
        for name, record in self.share.collected.items():
            if set(record["ids"]) <= self._wanted:
                self.records.remove(name)
