"""The requests of a stream: what each partition still needs and what is sent once for several.

Each partition's valid rows get a `request_key` (identical prompts share one with deterministic
decoding, so they are inferred once); the partition's checkpoints, then the result cache, answer the
keys they hold (`plan_partition`); the keys left over every partition become one list of requests,
a request pending in several partitions sent once (`stream_requests`), in shared-prefix order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from batch_assets.pipeline.engine_contract import Prompt
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN
from batch_assets.pipeline.result_stores import RESULT_SCHEMA, Checkpoints, ResultLookup

# Prompts encoded at a time at least, as the engine asks for more.
MIN_PROGRESS_BATCH = 64


@dataclass
class InferenceStats:
    rows: int = 0
    rows_inferred: int = 0
    rows_from_checkpoint: int = 0
    rows_from_cache: int = 0
    rows_cached: int = 0
    rows_deduplicated: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # The prompt tokens of the partition's rows that reached an engine, in this run or (results reused
    # from the cache or a checkpoint) the run that inferred them: what `prompt_tokens` and `cost_usd`
    # of inference_outputs count. A row with an error before the engine (a prompt too long, an empty
    # text) was never sent, so it costs nothing.
    sent_prompt_tokens: int = 0
    # From the first request to the last result of the stream this partition was part of:
    # tokenization, the engine and checkpoint writes (not engine start-up). Shared by the
    # partitions of one stream.
    engine_seconds: float = 0.0
    engine_start_seconds: float = 0.0
    engine_started: bool = False
    # What the task's kind measured of the partition besides inference (a cascade's student), for
    # inference_outputs' metadata.
    format_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def inference_seconds(self) -> float:
        """`engine_seconds` under the name the metadata and benchmarks have used since before the stream."""
        return self.engine_seconds

    @property
    def generated_tokens_per_second(self) -> float:
        return self.generated_tokens / self.engine_seconds if self.engine_seconds else 0.0

    @property
    def rows_per_second(self) -> float:
        return self.rows_inferred / self.engine_seconds if self.engine_seconds else 0.0


@dataclass
class PartitionInput:
    """One partition's share of a stream."""

    formatted: pl.DataFrame  # formatted_prompts: row_id, prompt, error, num_prompt_tokens, inputs
    # prompt texts → engine prompts (engine_contract.py), each built with its `key` (the request's
    # `request_key`, one per text); called as encode(texts, request_params, keys=keys) when
    # `formatted` has per-request params (OpenAI batch lines), else encode(texts, keys=keys)
    encode: Callable[..., list[Prompt]]
    checkpoints: Checkpoints | None = None
    label: str = ""  # names the partition in log lines when a stream has several


def request_keys(
    prompts: Sequence[str],
    row_ids: Sequence[int],
    deduplicate: bool,
    params: Sequence[str | None] | None = None,
    image_digests: Sequence[str | None] | None = None,
) -> list[str]:
    """Identical prompts share a key when decoding is deterministic, so they are inferred once.

    `params`: per-request sampling and output constraint (canonical JSON, e.g. each line of an
    OpenAI batch file), part of the key so requests that differ in them never share a result.
    `image_digests`: the content digest of each request's images (pipeline/inputs/images.py), so the same
    image under two names is one request and a replaced image under the same name a new one.
    """
    if params is not None:
        prompts = [p if q is None else f"{q}\x00{p}" for p, q in zip(prompts, params, strict=True)]
    if image_digests is not None:
        prompts = [p if d is None else f"image:{d}\x00{p}" for p, d in zip(prompts, image_digests, strict=True)]
    if deduplicate:
        return [hashlib.sha1(p.encode("utf-8")).hexdigest() for p in prompts]
    return [hashlib.sha1(f"{r}\x00{p}".encode()).hexdigest() for p, r in zip(prompts, row_ids, strict=True)]


@dataclass
class RequestPlan:
    part: PartitionInput
    stats: InferenceStats
    keyed: pl.DataFrame  # row_id, request_key of every valid row
    reused: list[pl.DataFrame]  # results from the cache and the checkpoints
    pending: pl.DataFrame  # request_key, prompt (, request_params): what this partition still needs
    step: int = MIN_PROGRESS_BATCH  # prompts encoded at a time, as the engine asks for more
    checkpoint_rows: int = 1024  # results per checkpoint chunk at most (`batch_size`)


def request_params_columns(formatted: pl.DataFrame) -> list[str]:
    """The columns besides the prompt that name a request: `request_params` (per-request sampling and
    output, OpenAI batch lines; absent for task-wide sampling) and an image task's images' digest."""
    params = ["request_params"] if "request_params" in formatted.columns else []
    return params + ([DIGEST_COLUMN] if DIGEST_COLUMN in formatted.columns else [])


def keyed_requests(formatted: pl.DataFrame, deduplicate: bool) -> pl.DataFrame:
    """The rows of `formatted` without an error (those an engine is sent), each with its
    `request_key`: what a run looks up in its checkpoints and the result cache (and `estimate` too)."""
    params = request_params_columns(formatted)
    valid = formatted.filter(pl.col("error").is_null()).select("row_id", "prompt", *params)
    return valid.with_columns(
        request_key=pl.Series(
            request_keys(
                valid["prompt"].to_list(),
                valid["row_id"].to_list(),
                deduplicate,
                valid["request_params"].to_list() if "request_params" in params else None,
                valid[DIGEST_COLUMN].to_list() if DIGEST_COLUMN in params else None,
            ),
            dtype=pl.String,
        )
    )


def plan_partition(
    part: PartitionInput, *, deduplicate: bool, cache: ResultLookup | None, batch_size: int
) -> RequestPlan:
    stats = InferenceStats(rows=part.formatted.height)
    params = request_params_columns(part.formatted)
    keyed = keyed_requests(part.formatted, deduplicate)
    unique_requests = keyed.unique("request_key", keep="first", maintain_order=True)
    stats.rows_deduplicated = keyed.height - unique_requests.height
    # The partition's own checkpoints first: a stopped attempt keeps its results in both stores, and
    # they count as `rows_from_checkpoint` (reused from an interrupted attempt); the cache serves the rest.
    done = part.checkpoints.load() if part.checkpoints is not None else pl.DataFrame(schema=RESULT_SCHEMA)
    done = done.join(unique_requests.select("request_key"), on="request_key", how="semi")
    remaining = unique_requests.join(done.select("request_key"), on="request_key", how="anti", maintain_order="left")
    cached = (
        cache.lookup(remaining["request_key"])
        if cache is not None and deduplicate
        else pl.DataFrame(schema=RESULT_SCHEMA)
    )
    pending = remaining.join(cached.select("request_key"), on="request_key", how="anti", maintain_order="left")
    stats.rows_from_cache, stats.rows_from_checkpoint = cached.height, done.height
    # Prompts are encoded ~10 % of the work at a time, at least 64 (tiny partitions are not cut into
    # tiny engine calls), never more than `batch_size`.
    step = min(batch_size, max(MIN_PROGRESS_BATCH, -(-pending.height // 10)))
    return RequestPlan(
        part,
        stats,
        keyed.select("row_id", "request_key"),
        [cached, done],
        pending.select("request_key", "prompt", *params),
        step,
        batch_size,
    )


@dataclass
class StreamRequests:
    """The stream's requests as columns, in the order they are sent: one row per request, no object
    per request (a 100,000-row partition is 100,000 requests)."""

    frame: pl.DataFrame  # request_key, prompt, request_params (null for task-wide sampling), owner
    owner: list[int]  # per request: the first partition waiting for its result (it encodes the prompt)
    shared: dict[int, list[int]]  # request index → the other partitions waiting for its result

    @property
    def keys(self) -> pl.Series:
        return self.frame["request_key"]

    def owners(self, index: int) -> list[int]:
        return [self.owner[index], *self.shared.get(index, ())]


def stream_requests(plans: list[RequestPlan], deduplicate: bool) -> StreamRequests:
    """One request per pending key; with deterministic decoding a prompt pending in several
    partitions is sent once and its result goes to each of them."""
    pending = pl.concat(
        [
            plan.pending.select(
                "request_key",
                "prompt",
                pl.col("request_params")
                if "request_params" in plan.pending.columns
                else pl.lit(None, dtype=pl.String).alias("request_params"),
                pl.col(DIGEST_COLUMN)
                if DIGEST_COLUMN in plan.pending.columns
                else pl.lit(None, dtype=pl.String).alias(DIGEST_COLUMN),
                owner=pl.lit(index, dtype=pl.Int64),
            )
            for index, plan in enumerate(plans)
        ]
    )
    if not deduplicate:
        return StreamRequests(pending, pending["owner"].to_list(), {})
    grouped = pending.group_by("request_key", maintain_order=True).agg(
        pl.col("prompt").first(), pl.col("request_params").first(), pl.col(DIGEST_COLUMN).first(), pl.col("owner")
    )
    # Stable, as Python's sort: requests with the same prompt text keep their order.
    grouped = grouped.sort(shared_prefix_order(), maintain_order=True)
    owners = grouped["owner"]
    shared_rows = (owners.list.len() > 1).arg_true().to_list()
    shared = {index: owners[index].to_list()[1:] for index in shared_rows}
    frame = grouped.with_columns(owner=owners.list.first())
    return StreamRequests(frame, frame["owner"].to_list(), shared)


def shared_prefix_order() -> pl.Expr:
    """Requests in the order of their prompt texts, so prompts that share a prefix (one document with
    several questions, one long instruction per customer) reach the engine one after another.

    vLLM reuses a prefix's KV cache only while it is still cached; in input order a file whose shared
    prefixes outgrow the cache computes each of them again and again. Sorted, a prefix is computed
    once and reused by the requests right behind it (the idea of SGLang's longest-prefix-first and
    Daft's prefix bucketing; a lexicographic order is a depth-first walk of the prefix tree). Only
    with deterministic decoding, where each answer is the most likely one whatever the order (in low
    precision a near-tie can tip with batching, in any order); results still land in
    their rows in input order. (Polars orders strings by their UTF-8 bytes: the code point order.)"""
    return pl.col("prompt")
