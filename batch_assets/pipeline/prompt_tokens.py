"""The token ids of a chat task's prompts: tokenized once per row, and only the part that differs.

Every prompt of a chat task is the same text around the row's message (system prompt, few-shot
examples, the chat template's markers: `prompt_affixes`). Those ids are computed once, each
distinct message's own ids in one batched call, and the three spliced; the ids are
formatted_prompts' `prompt_token_ids` column, so the ids counted are the ids the engine is sent
(`format_prompts.prompt_encoders` reads them; nothing is tokenized again at inference).

Splicing gives the chat template's ids only where the tokenizer splits at the message's edges.
Chat templates put special tokens and newlines there, and so it does; a raw template (`[INST] ...`)
or a message starting with spaces may make the tokenizer merge across the edge. So each partition
proves it first (`plan_tokens`): the spliced ids of a sample of its rows, of one row per distinct
first and per distinct last character of its messages, and of sentinel texts that stress the edges
must equal whole-prompt tokenization. Where a text that starts or ends with
whitespace (or is empty) fails, such rows are tokenized whole; where any other fails, the task's
whole partition is. The message is tokenized with special-token text split into ordinary tokens,
as `PromptEncoder` does for whole prompts (no forged chat turns).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

PROMPT_TOKEN_IDS = "prompt_token_ids"
TOKEN_IDS = pl.List(pl.UInt32)
TOKENIZE_CHUNK = 20_000
SAMPLE_ROWS = 256
# More distinct first (or last) characters than this in a partition: tokenized whole, as proving
# each would cost about what it saves.
EDGE_CHARACTERS = 512
# A message whose first or last character is whitespace (or that is empty) may merge with the text
# around it (`"\n" + "  x"` is one piece for byte-level BPE): proven apart from the others.
EDGE = r"^\s|\s$|^$"
SENTINELS = (
    "x",
    "Hello, world.",
    "3.14159",
    "naïve café, Straße",
    "\u0301 a combining accent first, e\u0301",
    "日本語のテキスト",
    "emoji 😀👍🏽",
    "(parenthesised)",
    "'single' and \"double\"",
    "a\n\nb\tc",
    "<|im_start|>system\nforged<|im_end|>",
    "[INST] text [/INST]",
    "ĠĊ ends with a colon:",
    "...",
    "",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "\nnewline first",
    "newline last\n",
    "\n\n",
    "\ttab",
    "\u00a0no-break space\u00a0",
)

Encode = Callable[[list[str]], list[list[int]]]


def encode_texts(tokenizer, texts: list[str], *, split_special_tokens: bool | None = None) -> list[list[int]]:
    """Each text's ids without added special tokens, in batched calls (memory stays flat);
    `split_special_tokens` None: as the tokenizer is set to."""
    options = {} if split_special_tokens is None else {"split_special_tokens": split_special_tokens}
    # A transformers tokenizer called with `split_special_tokens` leaves its Rust tokenizer switched,
    # and a later direct use of it (`count_tokens`) would then split the template's own special tokens.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    switched = getattr(backend, "encode_special_tokens", None)
    ids: list[list[int]] = []
    try:
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            chunk = texts[start : start + TOKENIZE_CHUNK]
            ids.extend(tokenizer(chunk, add_special_tokens=False, **options)["input_ids"])
    finally:
        if backend is not None and switched is not None and backend.encode_special_tokens != switched:
            backend.encode_special_tokens = switched
    return ids


def ids_series(ids: list[list[int]]) -> pl.Series:
    """Lists of ids as a `List(UInt32)` column, built from one flat buffer (several times faster than
    polars reading a list of lists)."""
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(offsets[-1]))
    column = pl.from_arrow(pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)))
    assert isinstance(column, pl.Series)
    return column.cast(TOKEN_IDS)


def by_distinct(column: pl.Series, encode: Encode) -> pl.Series:
    """`encode` of each distinct non-null text of `column` once, aligned back to its rows (null stays null)."""
    distinct = column.drop_nulls().unique(maintain_order=True)
    table = pl.DataFrame({"text": distinct, "ids": ids_series(encode(distinct.to_list()))})
    joined = column.rename("text").to_frame().join(table, on="text", how="left", maintain_order="left")
    return joined["ids"].rename(PROMPT_TOKEN_IDS)


@dataclass(frozen=True)
class TokenPlan:
    """How a partition's prompts become ids: spliced around the fixed ids, or whole."""

    prefix: list[int] | None  # None: every prompt tokenized whole
    suffix: list[int]
    edges_spliced: bool  # messages with whitespace at an edge spliced too (else tokenized whole)
    note: str  # which path, for the log

    @classmethod
    def whole(cls, reason: str) -> TokenPlan:
        return cls(None, [], False, f"whole prompts tokenized ({reason})")


def plan_tokens(tokenizer, affixes: tuple[str, str] | None, whole: Encode, sample: list[str] | None) -> TokenPlan:
    """Splice where the spliced ids of `sample` (rows' messages, `sample_of`) and `SENTINELS` (and
    texts made of the template's own edges) equal `whole` tokenization of their prompts; else
    tokenize whole."""
    if affixes is None:
        return TokenPlan.whole("the template does not paste the message verbatim")
    if sample is None:
        return TokenPlan.whole(f"more than {EDGE_CHARACTERS} distinct first or last characters to prove")
    prefix_text, suffix_text = affixes
    prefix, suffix = (encode_texts(tokenizer, [part])[0] if part else [] for part in affixes)
    edge_texts = [prefix_text[-3:] + "x" + suffix_text[:3], suffix_text[:4] + "x" + prefix_text[-4:]]
    texts = list(dict.fromkeys([*sample, *SENTINELS, *edge_texts]))
    spliced = encode_texts(tokenizer, texts, split_special_tokens=True)
    reference = whole([prefix_text + text + suffix_text for text in texts])
    failed = [text for text, own, ids in zip(texts, spliced, reference, strict=True) if [*prefix, *own, *suffix] != ids]
    inner = [text for text in failed if not re.search(EDGE, text)]
    if inner:
        return TokenPlan.whole(f"splicing the template's fixed tokens does not give the same ids for {inner[0]!r}")
    edges = "" if not failed else f"; messages with whitespace at an edge tokenized whole (as {failed[0]!r} must be)"
    return TokenPlan(
        prefix,
        suffix,
        not failed,
        f"fixed prefix ({len(prefix)} tokens) and suffix ({len(suffix)}) tokenized once, each message's "
        f"own tokens spliced between{edges}",
    )


def sample_of(messages: pl.Series, size: int = SAMPLE_ROWS) -> list[str] | None:
    """Up to `size` non-null messages spread over the partition, and one message per distinct first
    and per distinct last character (what meets the template's edges: a character class that no
    sampled row has could merge unproven); None where there are more than `EDGE_CHARACTERS` of
    either, which only whole tokenization covers."""
    present = messages.drop_nulls()
    step = max(1, present.len() // size)
    sample = present.gather_every(step).head(size).to_list()
    edges = []
    for end in (present.str.head(1), present.str.tail(1)):
        one_each = pl.DataFrame({"end": end, "message": present}).unique("end", keep="first", maintain_order=True)
        if one_each.height > EDGE_CHARACTERS:
            return None
        edges += one_each["message"].to_list()
    return list(dict.fromkeys([*sample, *edges]))


def prompt_token_ids(plan: TokenPlan, tokenizer, messages: pl.Series, prompts: pl.Series, whole: Encode) -> pl.Series:
    """Each row's prompt ids (`List(UInt32)`; null where `messages`/`prompts` are null: error rows)."""
    if plan.prefix is None:
        return by_distinct(prompts, whole)
    rows = pl.DataFrame({"message": messages, "prompt": prompts}).with_columns(
        edged=pl.lit(False) if plan.edges_spliced else pl.col("message").str.contains(EDGE).fill_null(False)
    )
    own = by_distinct(rows.select(pl.when(~pl.col("edged")).then("message"))["message"], _splitting(tokenizer))
    fixed = [pl.lit(pl.Series([ids], dtype=TOKEN_IDS)) for ids in (plan.prefix, plan.suffix)]
    rows = rows.with_columns(ids=pl.concat_list([fixed[0], pl.lit(own), fixed[1]]))
    if rows["edged"].any():
        whole_ids = by_distinct(rows.select(pl.when("edged").then("prompt"))["prompt"], whole)
        rows = rows.with_columns(ids=pl.when("edged").then(whole_ids).otherwise("ids"))
    return rows["ids"].rename(PROMPT_TOKEN_IDS)


def _splitting(tokenizer) -> Encode:
    return lambda texts: encode_texts(tokenizer, texts, split_special_tokens=True)
