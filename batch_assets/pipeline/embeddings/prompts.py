"""raw_prompts → formatted_prompts of an embedding or similarity task, and its texts → the
engine's prompts.

What can go wrong with a row, and what it becomes:
- an empty text: an `empty_text` error row naming file and line (a non-string field is refused when
  the file is read: `non_string_text`);
- a text longer than the model takes (`engine.max_model_len`, by default the model's own limit): an
  `input_too_long` error row naming file, line and `input.truncate`, or, with `input.truncate: true`,
  cut to the limit (`truncated` is true for that row), as sentence-transformers does;
- a text the tokenizer reads as mostly its unknown token (`[UNK]` for all-MiniLM-L6-v2: a word over
  100 characters, emoji, a script missing from its vocabulary): still embedded, but the vector says
  little about the text, so formatted_prompts marks the row (`mostly_unknown_tokens`), counts such
  rows in its metadata (`unknown_token_rows`) and logs a warning naming file and lines
  (`unknown_token_warning`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

from batch_assets.pipeline.engine_contract import Prompt, keys_of
from batch_assets.pipeline.format_prompts import TOKENIZE_CHUNK, Tokenizer, user_message_expr
from batch_assets.pipeline.validate_labels import UNKNOWN_TOKENS_COLUMN

# A row is marked when at least this share of its text's tokens (the model's special tokens aside)
# is the tokenizer's unknown token: half a text unread leaves a vector about the other half at best.
UNKNOWN_TOKEN_SHARE = 0.5
_LINES_SHOWN = 10


def count_text_tokens(tokenizer: Tokenizer, column: pl.Series) -> pl.Series:
    """Tokens of each text as the model gets it (its special tokens included, [CLS] and [SEP] for BERT
    models), never cut: the count says whether the text fits. Each distinct text is tokenized once."""
    return text_token_counts(tokenizer, column)["tokens"]


def text_token_counts(tokenizer: Tokenizer, column: pl.Series) -> pl.DataFrame:
    """Per text: `tokens` (as `count_text_tokens`) and `unknown_tokens`, how many of them are the
    tokenizer's unknown token (null for a tokenizer without one, as byte-level ones are).

    A copy of the Rust tokenizer is used where there is one, with truncation and padding off
    (`_encoding_backend`): a tokenizer.json may carry settings of its own (all-MiniLM-L6-v2's cuts
    and pads to 128 tokens), which transformers switches on or off at each call, so they depend on the
    call before (on a fresh tokenizer every short text counted 128 tokens).
    """
    distinct = column.drop_nulls().unique().to_list()
    backend = _encoding_backend(tokenizer, None)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk in {getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}:
        unk = None  # GPT-2-like tokenizers: the "unknown" id is the one they add to every text
    counts: list[int] = []
    unknown: list[int | None] = []
    for start in range(0, len(distinct), TOKENIZE_CHUNK):
        chunk = distinct[start : start + TOKENIZE_CHUNK]
        if backend is not None:
            encodings = backend.encode_batch_fast(chunk, add_special_tokens=True)
            counts.extend(len(encoding) for encoding in encodings)
            # `.ids` builds a list per text: only for tokenizers that have an unknown token at all.
            unknown.extend(encoding.ids.count(unk) if unk is not None else None for encoding in encodings)
        else:
            ids = tokenizer(chunk, add_special_tokens=True)["input_ids"]
            counts.extend(len(token_ids) for token_ids in ids)
            unknown.extend(token_ids.count(unk) if unk is not None else None for token_ids in ids)
    lengths = pl.DataFrame(
        {
            "text": pl.Series(distinct, dtype=pl.String),
            "tokens": pl.Series(counts, dtype=pl.Int64),
            "unknown_tokens": pl.Series(unknown, dtype=pl.Int64),
        }
    )
    return column.to_frame("text").join(lengths, on="text", how="left", maintain_order="left").drop("text")


def mostly_unknown(tokenizer: Tokenizer, counts: pl.DataFrame) -> pl.Series:
    """Whether at least `UNKNOWN_TOKEN_SHARE` of each text's own tokens (`text_token_counts`, the
    special tokens the tokenizer adds left out) are its unknown token; null where not counted."""
    special = _special_tokens_added(tokenizer)
    own = (pl.col("tokens") - special).clip(lower_bound=1)
    unknown = pl.col("unknown_tokens")
    return counts.select(((unknown > 0) & (unknown >= own * UNKNOWN_TOKEN_SHARE)).alias(UNKNOWN_TOKENS_COLUMN))[
        UNKNOWN_TOKENS_COLUMN
    ]


def _special_tokens_added(tokenizer: Tokenizer) -> int:
    count = getattr(tokenizer, "num_special_tokens_to_add", None)
    return int(count(pair=False)) if callable(count) else 0


def unknown_token_rows(formatted: pl.DataFrame) -> int:
    """How many rows of a formatted partition are marked `mostly_unknown_tokens`."""
    return int(formatted[UNKNOWN_TOKENS_COLUMN].sum() or 0) if UNKNOWN_TOKENS_COLUMN in formatted.columns else 0


def unknown_token_warning(formatted: pl.DataFrame, source_file: str) -> str | None:
    """The log line for a partition's rows marked `mostly_unknown_tokens`, naming file and lines."""
    if not unknown_token_rows(formatted):
        return None
    lines = formatted.filter(pl.col(UNKNOWN_TOKENS_COLUMN).fill_null(False))["source_line"].to_list()
    if not lines:
        return None
    shown = ", ".join(str(line) for line in lines[:_LINES_SHOWN]) + (", ..." if len(lines) > _LINES_SHOWN else "")
    return (
        f"{source_file}: {len(lines)} row(s) are mostly the tokenizer's unknown token (at least "
        f"{UNKNOWN_TOKEN_SHARE:.0%} of their tokens; line {shown}): their embeddings say little about their text "
        "(a word over 100 characters, emoji, a script missing from the model's vocabulary). They are embedded "
        "anyway; formatted_prompts counts them in unknown_token_rows"
    )


def format_embedding_prompts(
    raw: pl.DataFrame,
    template: str,
    text_fields: Sequence[str],
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    truncate: bool,
    source_file: str,
) -> pl.DataFrame:
    """raw_prompts → formatted_prompts of an embedding or similarity task: `prompt` is the template's
    text (what the model embeds, no chat template), `num_prompt_tokens` counts the model's special
    tokens too; empty and over-long texts become error rows (or, with `truncate`, cut: `truncated`)."""
    ok = pl.col("error").is_null()
    empty = pl.any_horizontal([pl.col(f).fill_null("").str.strip_chars().str.len_chars() == 0 for f in text_fields])
    frame = raw.with_columns(
        error=pl.when(ok & empty)
        .then(pl.format("empty_text: {} line {}: the text is empty", pl.lit(source_file), pl.col("source_line")))
        .otherwise(pl.col("error"))
    )
    ok = pl.col("error").is_null()
    frame = frame.with_columns(prompt=pl.when(ok).then(user_message_expr(template)))
    counts = text_token_counts(tokenizer, frame["prompt"])
    frame = frame.with_columns(
        num_prompt_tokens=counts["tokens"], **{UNKNOWN_TOKENS_COLUMN: mostly_unknown(tokenizer, counts)}
    )
    over = ok & (pl.col("num_prompt_tokens") > max_model_len)
    if truncate:
        return frame.with_columns(
            truncated=pl.when(ok).then(over),
            num_prompt_tokens=pl.when(over).then(pl.lit(max_model_len, dtype=pl.Int64)).otherwise("num_prompt_tokens"),
        )
    frame = frame.with_columns(
        error=pl.when(over)
        .then(
            pl.format(
                "input_too_long: {} line {}: {} tokens exceed the model's limit of {} (engine.max_model_len); "
                "set input.truncate: true in the task to embed the first {} tokens instead",
                pl.lit(source_file),
                pl.col("source_line"),
                pl.col("num_prompt_tokens"),
                pl.lit(max_model_len),
                pl.lit(max_model_len),
            )
        )
        .otherwise(pl.col("error"))
    )
    return frame.with_columns(prompt=pl.when(pl.col("error").is_null()).then(pl.col("prompt")))


def embedding_encoder(tokenizer: Tokenizer, max_model_len: int, truncate: bool) -> Callable[..., list[Prompt]]:
    """Texts → the token ids the pooling runner embeds: the model's special tokens added, as
    sentence-transformers and vLLM's `LLM.embed` tokenize; cut to `max_model_len` with `truncate`
    (too-long texts never get here otherwise: they are error rows). Each prompt keeps its text too:
    an endpoint is sent the text, and its server tokenizes it the same way."""
    backend = _encoding_backend(tokenizer, max_model_len if truncate else None)
    options: dict[str, Any] = {"add_special_tokens": True}
    if truncate:
        options |= {"truncation": True, "max_length": max_model_len}

    def encode(texts: list[str], keys: list[str] | None = None) -> list[Prompt]:
        if not texts:
            return []
        if backend is not None:
            ids = [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]
        else:
            ids = tokenizer(texts, **options)["input_ids"]
        return [
            Prompt(tuple(token_ids), text=text, key=key)
            for token_ids, text, key in zip(ids, texts, keys_of(texts, keys), strict=True)
        ]

    return encode


def _encoding_backend(tokenizer: Tokenizer, max_length: int | None) -> Any:
    """A copy of the tokenizer's Rust tokenizer that encodes as `tokenizer(texts, truncation=...,
    max_length=max_length)` does (the same ids), without the Python layer of that call (a third of
    its time, spent on the thread that feeds the engine); None without a Rust tokenizer. A copy of
    its own, set once: the tokenizer's own one has its truncation and padding switched at each call,
    and its tokenizer.json may pad or cut of its own accord."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    try:
        copy = type(backend).from_str(backend.to_str())
    except Exception:  # a tokenizer with parts that do not serialize: the ordinary call
        return None
    if hasattr(copy, "encode_special_tokens"):  # what transformers sets on each call
        copy.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    copy.no_padding()
    if max_length is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_length, direction=getattr(tokenizer, "truncation_side", "right"))
    return copy
