"""Turn raw prompt rows into the exact text the model sees, with token counts.

The user message comes from the task template over the input fields; system + user messages are
rendered with the model's own chat template (or the task's `raw_template` for models without one).
Few-shot examples (`prompt.examples`) come between them as earlier user / assistant turns, their
user turns made from the same template; they are the same in every prompt, so they are part of the
fixed text around the row's message, whose tokens are counted once per partition and added to each
row's (where the template pastes the message verbatim, as chat templates do; else per row).
Rows whose text is empty, or whose prompt plus `max_tokens` would not fit the model's context,
get an `error` here so they never reach the engine.

User text is text: a record containing the model's special tokens (`<|im_start|>`, `<|im_end|>`,
...) must not open a chat turn of its own (prompt injection). `PromptEncoder` turns prompts into
token ids with the user message tokenized with special tokens split into ordinary tokens, and only
the chat template's own special tokens left special; token counts here follow the same rule.
`prompt_encoder` wraps those ids as the engine's `Prompt`s (with the chat messages, for an engine
that sends them).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import polars as pl

from batch_assets.pipeline.engine_contract import Engine, Prompt, keys_of
from batch_assets.pipeline.inputs.images import DIGEST_COLUMN, IMAGES_COLUMN, image_data_url, image_url_part
from batch_assets.pipeline.prompt_tokens import (
    PROMPT_TOKEN_IDS,
    TOKENIZE_CHUNK,
    encode_texts,
    plan_tokens,
    prompt_token_ids,
    sample_of,
)
from batch_assets.pipeline.task_spec import DEFAULT_RAW_EXAMPLE_TEMPLATE, example_answer_text

_SENTINEL = "\u2063BATCH_ASSETS_USER_TEXT\u2063"


class Tokenizer(Protocol):
    chat_template: str | None

    def apply_chat_template(self, conversation, tokenize: bool = ..., add_generation_prompt: bool = ...) -> str: ...

    def __call__(self, text, add_special_tokens: bool = ..., split_special_tokens: bool = ...): ...


@dataclass(frozen=True)
class PromptFormat:
    system: str
    template: str
    raw_template: str | None
    text_fields: tuple[str, ...]
    # Few-shot examples as (user message, answer) turns, in the task's order: the user message is
    # the task's template over the example's fields, exactly as a row's is.
    examples: tuple[tuple[str, str], ...] = ()
    raw_example_template: str = DEFAULT_RAW_EXAMPLE_TEMPLATE
    # Images sent with each row's message (`input.image_fields`): that many image parts before its text.
    image_count: int = 0

    @classmethod
    def of(cls, task) -> PromptFormat:
        """The prompt format of a `TaskSpec`."""
        prompt = task.prompt
        examples = tuple(
            (fill_template(prompt.template, example.input), example_answer_text(example.answer, task.output))
            for example in prompt.examples
        )
        return cls(
            prompt.system,
            prompt.template,
            prompt.raw_template,
            tuple(task.input.text_fields),
            examples,
            prompt.raw_example_template or DEFAULT_RAW_EXAMPLE_TEMPLATE,
            len(task.input.image_fields),
        )


def fill_template(template: str, fields: dict[str, str]) -> str:
    """The template over one record's fields (what `user_message_expr` does column-wise)."""
    return template.format(**fields)


def messages_for(
    system: str, user: str, examples: Sequence[tuple[str, str]] = (), images: int | Sequence[dict[str, Any]] = 0
) -> list[dict[str, Any]]:
    """The chat: the system prompt, each example as a user turn and its answer as the assistant's
    turn, then the row's message; with `images`, the message is that many image parts and then its
    text (OpenAI's content parts, which vision-language chat templates and `LLM.chat` read).
    `images` as a count: placeholder parts (`{"type": "image"}`, what a chat template renders); as
    parts: those parts (an endpoint's `image_url` parts, `images.image_url_part`)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for example_user, answer in examples:
        messages += [{"role": "user", "content": example_user}, {"role": "assistant", "content": answer}]
    if images:
        parts = [{"type": "image"}] * images if isinstance(images, int) else list(images)
        return [*messages, {"role": "user", "content": [*parts, {"type": "text", "text": user}]}]
    return [*messages, {"role": "user", "content": user}]


def raw_examples(fmt: PromptFormat) -> str:
    """`{examples}` of a raw template: each example through `raw_example_template`, in order."""
    return "".join(fmt.raw_example_template.format(user=user, answer=answer) for user, answer in fmt.examples)


# Why an image task's prompts cannot be rendered with this tokenizer, and the setting that fixes it.
NO_PLACE_FOR_PICTURES = (
    "the tokenizer's chat template has no place for a picture (it renders text only), so the prompts cannot be "
    "rendered or counted: set engine.tokenizer to the vision-language model's tokenizer (a local folder or a "
    "Hugging Face id whose chat template takes image parts, e.g. HuggingFaceTB/SmolVLM-256M-Instruct); on the "
    "in-process engine, engine.model (or BATCH_ASSETS_MODEL) must name a vision-language model"
)


def places_pictures(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template puts something in a message for each image part, as a
    vision-language model's does (`<image>`, `<|image_pad|>`, ...). A text model's template raises on
    content parts, prints them as Python text or drops the picture: no place for it."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    text = {"type": "text", "text": _SENTINEL}
    try:
        with_picture, without = (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
            )
            for parts in ([{"type": "image"}, text], [text])
        )
    except Exception:  # a template may raise on content parts (a string concatenation, raise_exception)
        return False
    return with_picture.count(_SENTINEL) == 1 and "'type'" not in with_picture and with_picture != without


def render_prompt(fmt: PromptFormat, tokenizer: Tokenizer, user: str) -> str:
    """The full prompt text for one user message (the reference for the vectorized path)."""
    if fmt.raw_template is not None:
        return fmt.raw_template.format(system=fmt.system, user=user, examples=raw_examples(fmt))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model's tokenizer has no chat template; set `prompt.raw_template` in the task YAML "
            "(e.g. '[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST]')"
        )
    messages = messages_for(fmt.system, user, fmt.examples, fmt.image_count)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def user_message_expr(template: str) -> pl.Expr:
    """The task template as a polars expression (a `str.format` over columns, vectorized)."""
    parts: list[pl.Expr] = []
    for literal, field, format_spec, conversion in string.Formatter().parse(template):
        if literal:
            parts.append(pl.lit(literal))
        if field is not None:
            if format_spec or conversion:
                raise ValueError(f"template field {{{field}}}: format specs and conversions are not supported")
            parts.append(pl.col(field).fill_null(""))
    return pl.concat_str(parts) if parts else pl.lit("")


def user_messages(frame: pl.DataFrame, template: str) -> list[str]:
    """Each row's user message: `with_columns` repeats a template that names no field (an image
    task's constant question) on every row, where `select` would give it once."""
    return frame.with_columns(user_message_expr(template).alias("_user_message"))["_user_message"].to_list()


def prompt_affixes(fmt: PromptFormat, tokenizer: Tokenizer) -> tuple[str, str] | None:
    """Text before and after the user message, when the template inserts it verbatim.

    Rendering a Jinja chat template per row costs more than the rest of this stage; most
    templates paste the message unchanged, so render once around a sentinel and concatenate.
    Returns None (render per row) when the template alters the message (e.g. trims it).
    """
    rendered = render_prompt(fmt, tokenizer, _SENTINEL)
    if rendered.count(_SENTINEL) != 1:
        return None
    prefix, suffix = rendered.split(_SENTINEL)
    for probe in (" padded text ", "line one\nline two", '{braces} and "quotes"'):
        if render_prompt(fmt, tokenizer, probe) != prefix + probe + suffix:
            return None
    return prefix, suffix


def prompt_segments(fmt: PromptFormat, tokenizer: Tokenizer) -> tuple[str, str] | None:
    """Text before and after the user message in every rendered prompt (None: no single place)."""
    rendered = render_prompt(fmt, tokenizer, _SENTINEL)
    if rendered.count(_SENTINEL) != 1:
        return None
    prefix, suffix = rendered.split(_SENTINEL)
    return prefix, suffix


def special_tokens(tokenizer: Tokenizer) -> list[str]:
    """The text of the tokenizer's special tokens, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {token.content for token in decoder.values() if getattr(token, "special", False)}
    specials |= set(getattr(tokenizer, "all_special_tokens", None) or [])
    specials.discard("")
    return sorted(specials, key=len, reverse=True)


class PromptEncoder:
    """Prompt texts → token ids, with the user message always tokenized as plain text.

    A prompt whose user message holds no special-token text is tokenized whole, as before (the
    common case, one batched call). Otherwise it is tokenized in three parts: the template's text
    before the message and after it as usual, the message with `split_special_tokens`, so
    `<|im_start|>` in a record becomes the tokens of the characters `<|im_start|>`.
    """

    def __init__(self, fmt: PromptFormat, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.specials = special_tokens(tokenizer)
        self.pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.segments = prompt_segments(fmt, tokenizer) if self.pattern is not None else None
        self._segment_ids: tuple[list[int], list[int]] | None = None

    def user_text(self, prompt: str) -> str | None:
        """The user message inside a rendered prompt (None when the template gives no single place)."""
        if self.segments is None:
            return None
        prefix, suffix = self.segments
        if len(prompt) < len(prefix) + len(suffix) or not (prompt.startswith(prefix) and prompt.endswith(suffix)):
            return None
        return prompt[len(prefix) : len(prompt) - len(suffix)]

    def needs_splitting(self, prompts: list[str]) -> list[bool]:
        """Per prompt: whether its user message holds special-token text (vectorized; usually none).

        Without a single place for the message (`segments` None) nothing is split here: such rows
        became `special_tokens` error rows in format_prompts and never reach the engine.
        """
        if self.segments is None or not self.specials or not prompts:
            return [False] * len(prompts)
        prefix, suffix = self.segments
        texts = pl.Series(prompts, dtype=pl.String)
        fits = texts.str.starts_with(prefix) & texts.str.ends_with(suffix)
        fits &= texts.str.len_chars() >= len(prefix) + len(suffix)
        middle = texts.str.strip_prefix(prefix).str.strip_suffix(suffix)
        return (fits & middle.str.contains_any(self.specials)).to_list()

    def encode(self, prompts: list[str]) -> list[list[int]]:
        ids = encode_texts(self.tokenizer, prompts)
        for index, split in enumerate(self.needs_splitting(prompts)):
            if split:
                ids[index] = self._encode_split(prompts[index])
        return ids

    def _encode_split(self, prompt: str) -> list[int]:
        user = self.user_text(prompt)
        if user is None:
            # format_prompts turns such rows into `special_tokens` error rows; never guess here.
            raise ValueError("a prompt with special-token text in its user message does not fit the chat template")
        if self._segment_ids is None:
            assert self.segments is not None  # set whenever the tokenizer has special tokens to split
            prefix, suffix = self.segments
            prefix_ids, suffix_ids = (
                encode_texts(self.tokenizer, [part])[0] if part else [] for part in (prefix, suffix)
            )
            self._segment_ids = (prefix_ids, suffix_ids)
        [plain] = encode_texts(self.tokenizer, [user], split_special_tokens=True)
        return [*self._segment_ids[0], *plain, *self._segment_ids[1]]


def count_tokens(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """Token counts without special tokens, in chunks so memory stays flat on big partitions."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    counts: list[int] = []
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start : start + TOKENIZE_CHUNK]
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The Rust tokenizer directly: no Python lists of ids (10x less memory, 3x faster).
            counts.extend(len(encoding) for encoding in backend.encode_batch_fast(chunk, add_special_tokens=False))
        else:
            counts.extend(len(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"])
    return counts


def format_prompts(
    raw: pl.DataFrame,
    fmt: PromptFormat,
    tokenizer: Tokenizer,
    *,
    max_model_len: int,
    max_tokens: int,
    source_file: str,
    log: Callable[[str], None] = lambda note: None,
) -> pl.DataFrame:
    """raw_prompts → formatted_prompts: adds `prompt`, its `prompt_token_ids` (what the engine is
    sent) and `num_prompt_tokens`, flags unusable rows; `log` is told how the ids were made."""
    refuse_special_tokens_in_examples(fmt, tokenizer)
    if fmt.image_count and not places_pictures(tokenizer):
        raise ValueError(f"input.image_fields: {NO_PLACE_FOR_PICTURES}")
    ok = pl.col("error").is_null()
    # An image task may have no text field (the template is the whole message): nothing to be empty.
    empty = (
        pl.any_horizontal([pl.col(f).fill_null("").str.strip_chars().str.len_chars() == 0 for f in fmt.text_fields])
        if fmt.text_fields
        else pl.lit(False)
    )
    frame = raw.with_columns(
        error=pl.when(ok & empty)
        .then(pl.format("empty_text: {} line {}: the text is empty", pl.lit(source_file), pl.col("source_line")))
        .otherwise(pl.col("error")),
        user_message=user_message_expr(fmt.template),
    )
    affixes = prompt_affixes(fmt, tokenizer)
    ok = pl.col("error").is_null()
    if affixes is not None:
        prefix, suffix = affixes
        frame = frame.with_columns(prompt=pl.when(ok).then(pl.lit(prefix) + pl.col("user_message") + pl.lit(suffix)))
    else:
        frame = frame.with_columns(
            prompt=pl.when(ok).then(
                pl.col("user_message").map_elements(
                    lambda user: render_prompt(fmt, tokenizer, user), return_dtype=pl.String
                )
            )
        )
    encoder = PromptEncoder(fmt, tokenizer)
    frame = _refuse_special_tokens_without_place(frame, encoder, source_file)
    frame = frame.with_columns(_token_ids(frame, affixes, tokenizer, encoder, log))
    frame = frame.with_columns(num_prompt_tokens=pl.col(PROMPT_TOKEN_IDS).list.len().cast(pl.Int64))
    frame = _refuse_too_long(frame, fmt, tokenizer, max_model_len, max_tokens, source_file)
    valid = pl.col("error").is_null()
    return frame.drop("user_message").with_columns(
        prompt=pl.when(valid).then(pl.col("prompt")), **{PROMPT_TOKEN_IDS: pl.when(valid).then(PROMPT_TOKEN_IDS)}
    )


def _token_ids(
    frame: pl.DataFrame,
    affixes: tuple[str, str] | None,
    tokenizer: Tokenizer,
    encoder: PromptEncoder,
    log: Callable[[str], None],
) -> pl.Series:
    """The ids of each valid row's prompt, made once (prompt_tokens.py): the template's fixed ids
    spliced around each message's own where a sample of the rows proves it exact, else whole."""
    valid = frame.select(
        message=pl.when(pl.col("error").is_null()).then("user_message"),
        prompt=pl.when(pl.col("error").is_null()).then("prompt"),
    )
    plan = plan_tokens(tokenizer, affixes, encoder.encode, sample_of(valid["message"]))
    log(plan.note)
    return prompt_token_ids(plan, tokenizer, valid["message"], valid["prompt"], encoder.encode)


def _refuse_too_long(
    frame: pl.DataFrame, fmt: PromptFormat, tokenizer: Tokenizer, max_model_len: int, max_tokens: int, source_file: str
) -> pl.DataFrame:
    """Rows whose prompt and `max_tokens` do not fit the context get a `prompt_too_long` error."""
    budget = max_model_len - max_tokens
    too_long = pl.col("error").is_null() & (pl.col("num_prompt_tokens") > budget)
    # With examples, a too-long row says how much of it they are: the fix may be fewer of them.
    note = _examples_share(fmt, tokenizer) if fmt.examples and frame.select(too_long.any()).item() else ""
    return frame.with_columns(
        error=pl.when(too_long)
        .then(
            pl.format(
                "prompt_too_long: {} line {}: {} prompt tokens + {} max_tokens exceed max_model_len {}{}",
                pl.lit(source_file),
                pl.col("source_line"),
                pl.col("num_prompt_tokens"),
                pl.lit(max_tokens),
                pl.lit(max_model_len),
                pl.lit(note),
            )
        )
        .otherwise(pl.col("error"))
    )


def _examples_share(fmt: PromptFormat, tokenizer: Tokenizer) -> str:
    """How much of every prompt the examples take: the note of a too-long row, so the fix (fewer or
    shorter examples) is found from the error."""
    plain = PromptFormat(fmt.system, fmt.template, fmt.raw_template, fmt.text_fields)
    with_examples, without = (render_prompt(f, tokenizer, "") for f in (fmt, plain))
    tokens = count_tokens(tokenizer, [with_examples])[0] - count_tokens(tokenizer, [without])[0]
    return f" ({len(fmt.examples)} prompt.examples take {tokens} tokens of every prompt)"


def refuse_special_tokens_in_examples(fmt: PromptFormat, tokenizer: Tokenizer) -> None:
    """An example holding the model's special-token text would open forged chat turns in every
    prompt (examples are tokenized with the template's own text): refused, naming the example."""
    specials = special_tokens(tokenizer) if fmt.examples else []
    for index, (user, answer) in enumerate(fmt.examples):
        token = next((token for token in specials if token in user or token in answer), None)
        if token is not None:
            raise ValueError(
                f"prompt.examples.{index} contains the model's special token {token!r}; "
                "remove it from the example's input and answer"
            )


def _refuse_special_tokens_without_place(frame: pl.DataFrame, encoder: PromptEncoder, source_file: str) -> pl.DataFrame:
    """A row whose user text holds special-token text, where the chat template gives no single place
    for the message to keep it plain text (so its ids cannot be made safely), gets a
    `special_tokens` error instead of reaching the model with forged chat turns."""
    if not encoder.specials:
        return frame
    ok = pl.col("error").is_null()
    candidates = frame.with_row_index("_position").filter(
        ok & pl.col("user_message").str.contains_any(encoder.specials)
    )
    if candidates.height == 0:
        return frame
    errors = frame["error"].to_list()
    for position, prompt, user, line in candidates.select(
        "_position", "prompt", "user_message", "source_line"
    ).iter_rows():
        if encoder.user_text(prompt) is None:
            # Candidates hold special-token text, so the pattern of those tokens exists and matches.
            assert encoder.pattern is not None
            match = encoder.pattern.search(user)
            assert match is not None
            errors[position] = (
                f"special_tokens: {source_file} line {line}: the text contains the model's special token "
                f"{match.group()!r}, and this chat template gives no single place for the message to keep it "
                "as plain text"
            )
    return frame.with_columns(error=pl.Series(errors, dtype=pl.String))


# --- what the engine is sent ------------------------------------------------------------------


def prompt_encoders(
    engine: Engine, prompt_format: PromptFormat, tokenizer
) -> Callable[[pl.DataFrame], Callable[..., list[Prompt]]]:
    """For each partition's formatted prompts, the encoder of its prompt texts → `Prompt`s for
    `engine`; what does not depend on the partition (the tokenizer's special tokens, the chat
    template's text around the message) is worked out once, here.

    For an engine that sends chat messages, each prompt also carries the row's messages, rebuilt
    from the input columns with the task's template (the same messages the prompt was rendered
    from, few-shot examples included). The in-process engine gets token ids only: nothing extra is built.
    """
    # Special-token text in a record stays text (`PromptEncoder`): no forged chat turns. Only for
    # formatted_prompts stored without their ids (made before they were kept); else the ids are read.
    token_ids = PromptEncoder(prompt_format, tokenizer).encode

    def for_partition(formatted: pl.DataFrame) -> Callable[..., list[Prompt]]:
        valid = formatted.filter(pl.col("error").is_null())
        ids_of = stored_token_ids(valid) if PROMPT_TOKEN_IDS in valid.columns else token_ids
        if IMAGES_COLUMN in valid.columns:
            # Equal digests are equal bytes: one row's images serve every request of that digest.
            images_of = dict(zip(valid[DIGEST_COLUMN].to_list(), valid[IMAGES_COLUMN].to_list(), strict=True))
            if engine.sends_chat_messages:
                return image_messages_encoder(prompt_format, valid, images_of, ids_of)

            def encode_images(
                prompts: list[str], keys: list[str] | None = None, image_digests: list[str] | None = None
            ) -> list[Prompt]:
                assert image_digests is not None  # run_inference passes them for every image task
                return [
                    Prompt(tuple(ids), key=key, images=tuple(images_of[digest]))
                    for ids, key, digest in zip(ids_of(prompts), keys_of(prompts, keys), image_digests, strict=True)
                ]

            return encode_images
        if not engine.sends_chat_messages:

            def encode_ids(prompts: list[str], keys: list[str] | None = None) -> list[Prompt]:
                return [
                    Prompt(tuple(ids), key=key)
                    for ids, key in zip(ids_of(prompts), keys_of(prompts, keys), strict=True)
                ]

            return encode_ids
        # Identical prompts come from identical user messages, so the prompt text is a safe key.
        user_by_prompt = dict(zip(valid["prompt"].to_list(), user_messages(valid, prompt_format.template), strict=True))

        def encode(prompts: list[str], keys: list[str] | None = None) -> list[Prompt]:
            return [
                Prompt(
                    tuple(ids),
                    tuple(messages_for(prompt_format.system, user_by_prompt[prompt], prompt_format.examples)),
                    key=key,
                )
                for prompt, ids, key in zip(prompts, ids_of(prompts), keys_of(prompts, keys), strict=True)
            ]

        return encode

    return for_partition


def image_messages_encoder(
    fmt: PromptFormat,
    valid: pl.DataFrame,
    images_of: dict[str, list[bytes]],
    ids_of: Callable[[list[str]], list[list[int]]],
) -> Callable[..., list[Prompt]]:
    """An image task's encoder for an engine that sends chat messages (an endpoint, a batch API): the
    row's user message is its images as `image_url` parts with `data:` URLs of their bytes, in the
    task's field order, then its text, as OpenAI's chat API takes pictures. The ids (counted, keyed)
    stay those of the rendered prompt with its image placeholders."""
    users = user_messages(valid, fmt.template)
    # A rendered prompt holds no image, so a request is found by its prompt and its images' digest.
    user_of = dict(zip(zip(valid["prompt"].to_list(), valid[DIGEST_COLUMN].to_list(), strict=True), users, strict=True))

    def encode(
        prompts: list[str], keys: list[str] | None = None, image_digests: list[str] | None = None
    ) -> list[Prompt]:
        assert image_digests is not None  # run_inference passes them for every image task
        out = []
        for prompt, ids, key, digest in zip(
            prompts, ids_of(prompts), keys_of(prompts, keys), image_digests, strict=True
        ):
            parts = [image_url_part(image_data_url(data)) for data in images_of[digest]]
            messages = messages_for(fmt.system, user_of[(prompt, digest)], fmt.examples, parts)
            out.append(Prompt(tuple(ids), tuple(messages), key=key))
        return out

    return encode


def stored_token_ids(valid: pl.DataFrame) -> Callable[[list[str]], list[list[int]]]:
    """The ids formatted_prompts made of each prompt (`prompt_token_ids`), looked up by prompt text:
    the ids that were counted are the ids sent, and nothing is tokenized again."""
    # Identical prompt texts have identical ids, so the last row of a text serves them all.
    row_of = {prompt: row for row, prompt in enumerate(valid["prompt"].to_list())}
    column = valid[PROMPT_TOKEN_IDS]
    return lambda prompts: column.gather([row_of[prompt] for prompt in prompts]).to_list()
