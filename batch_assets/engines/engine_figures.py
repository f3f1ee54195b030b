"""What an engine itself saw while it ran a stream, as inference_outputs metadata.

The in-process engine feeds `EngineFigures` from vLLM's stat-logging interface
(runtime/vllm_stats.py): prefix-cache queries and hits, preemptions, KV-cache usage, time to first
token and queue time of each request, prompt and generated tokens. The engine is warm across steps,
so a session takes a `mark()` when its first stream starts and reports what came after it
(`since(mark)`). Times are kept in log-spaced buckets (2 % wide), so a run of millions of requests
keeps a few hundred counters, and its percentiles are within 2 %.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_BUCKET_RATIO = 1.02
_LOG_RATIO = math.log(_BUCKET_RATIO)
_SMALLEST = 1e-4  # seconds; shorter times share the first bucket


def _bucket(seconds: float) -> int:
    return 0 if seconds <= _SMALLEST else 1 + int(math.log(seconds / _SMALLEST) / _LOG_RATIO)


def _bucket_top(index: int) -> float:
    return _SMALLEST if index == 0 else _SMALLEST * _BUCKET_RATIO**index


def percentile(counts: Counter[int], share: float) -> float | None:
    """The `share` (0-1) percentile of the times counted by bucket: its bucket's upper edge."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank, seen = share * total, 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return round(_bucket_top(index), 4)
    return round(_bucket_top(max(counts)), 4)


@dataclass
class _Totals:
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Counter[int] = field(default_factory=Counter)
    queue: Counter[int] = field(default_factory=Counter)

    def copy(self) -> _Totals:
        return _Totals(
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            Counter(self.ttft),
            Counter(self.queue),
        )


@dataclass(frozen=True)
class Mark:
    totals: _Totals
    at: float  # time.monotonic() of the mark


class EngineFigures:
    """Totals of one engine's statistics since it started; written from the engine's event loop,
    read from the step's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._kv_peak = 0.0  # since the latest mark
        self._last_record: float | None = None

    def scheduler(self, kv_cache_usage: float, prefix_queries: int, prefix_hits: int) -> None:
        """One engine step's scheduler figures: KV-cache usage (0-1), prefix-cache tokens looked up and found."""
        with self._lock:
            self._kv_peak = max(self._kv_peak, kv_cache_usage)
            self._totals.prefix_queries += prefix_queries
            self._totals.prefix_hits += prefix_hits

    def iteration(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        preemptions: int,
        first_token_seconds: Iterable[float],
        queued_seconds: Iterable[float],
    ) -> None:
        """One batch of engine outputs: tokens, preempted requests, and per request its time to the
        first token (requests that got theirs) and time in the queue (requests that finished)."""
        with self._lock:
            totals = self._totals
            totals.prompt_tokens += prompt_tokens
            totals.generation_tokens += generation_tokens
            totals.preemptions += preemptions
            totals.ttft.update(_bucket(seconds) for seconds in first_token_seconds)
            totals.queue.update(_bucket(seconds) for seconds in queued_seconds)
            self._last_record = time.monotonic()

    def mark(self) -> Mark:
        with self._lock:
            self._kv_peak = 0.0
            return Mark(self._totals.copy(), time.monotonic())

    def since(self, mark: Mark) -> dict[str, Any]:
        """inference_outputs metadata of what the engine did after `mark`."""
        with self._lock:
            now, before = self._totals, mark.totals
            queries = now.prefix_queries - before.prefix_queries
            hits = now.prefix_hits - before.prefix_hits
            ttft, queue = now.ttft - before.ttft, now.queue - before.queue
            seconds = (self._last_record or mark.at) - mark.at
            prompt = now.prompt_tokens - before.prompt_tokens
            generated = now.generation_tokens - before.generation_tokens
            figures: dict[str, Any] = {
                "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
                "preemptions": now.preemptions - before.preemptions,
                "kv_cache_usage_peak": round(self._kv_peak, 4),
                "engine_prompt_tokens_per_second": round(prompt / seconds, 2) if seconds > 0 else 0.0,
                "engine_generation_tokens_per_second": round(generated / seconds, 2) if seconds > 0 else 0.0,
            }
        for name, counts in (("ttft", ttft), ("queue_time", queue)):
            for share in (50, 95):
                value = percentile(counts, share / 100)
                if value is not None:
                    figures[f"{name}_p{share}_s"] = value
        return figures


class EndpointFigures:
    """What an endpoint's HTTP traffic was like: requests made (a retry is one more), 429 answers,
    and each call's latency, its retries included. Written from the client's event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = self.attempts = self.too_many = 0
        self._latency: Counter[int] = Counter()

    def attempt(self) -> None:
        with self._lock:
            self.attempts += 1

    def response(self, status: int) -> None:
        if status == 429:
            with self._lock:
                self.too_many += 1

    def call_done(self, seconds: float) -> None:
        with self._lock:
            self.calls += 1
            self._latency[_bucket(seconds)] += 1

    def metadata(self) -> dict[str, Any]:
        """inference_outputs metadata of an endpoint's session (empty when it sent nothing)."""
        with self._lock:
            if not self.calls:
                return {}
            figures: dict[str, Any] = {
                "http_requests": self.attempts,
                "http_retries": max(0, self.attempts - self.calls),
                "http_429s": self.too_many,
            }
            latency = Counter(self._latency)
        for share in (50, 95):
            value = percentile(latency, share / 100)
            if value is not None:
                figures[f"latency_p{share}_s"] = value
        return figures


# A provider's Batch object's timestamps (Unix seconds; OpenAI's names), in the order a batch passes them.
_BATCH_ENDS = ("completed_at", "failed_at", "expired_at", "cancelled_at", "finalizing_at")


class BatchTimes:
    """What the provider's batches took by its own clock: waiting before it ran them, and running."""

    def __init__(self) -> None:
        self.created: list[float] = []
        self.waits: list[float] = []  # in_progress_at - created_at
        self.runs: list[float] = []  # the end - in_progress_at
        self.ends: list[float] = []

    def add(self, batch: Any) -> None:
        """One finished batch (a response without the timestamps adds what it has)."""
        created, started = getattr(batch, "created_at", None), getattr(batch, "in_progress_at", None)
        end = next((value for name in _BATCH_ENDS if (value := getattr(batch, name, None))), None)
        if created:
            self.created.append(float(created))
        if created and started:
            self.waits.append(float(started) - float(created))
        if started and end:
            self.runs.append(float(end) - float(started))
        if end:
            self.ends.append(float(end))

    def metadata(self) -> dict[str, float]:
        figures: dict[str, float] = {}
        if self.waits:
            figures["batch_provider_wait_seconds"] = round(max(self.waits), 3)
        if self.runs:
            figures["batch_provider_run_seconds"] = round(max(self.runs), 3)
        if self.created and self.ends:
            figures["batch_provider_total_seconds"] = round(max(self.ends) - min(self.created), 3)
        return figures
