"""The files a Batch API engine uploads and downloads: request lines in, answers out, by `custom_id`.

Request lines are OpenAI's batch input format (`{"custom_id", "method", "url", "body"}`, one JSON
object a line, the same format the `openai_batch` task reads: pipeline/openai_batch/). A line's
`custom_id` is a hash of its body and its request key (and its rank among identical ones of the
stream), so the same request gets the same id in every run: that is what lets a re-run find the
batch that already holds it (engines/batch_api_engine.py). Answers come back as output and error lines
(`{"custom_id", "response": {"status_code", "body"}, "error"}`) and become `Generation`s, one per
request however often the files mention it (`settle_answers`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from batch_assets.engines.endpoint_requests import token_logprobs_text
from batch_assets.pipeline.engine_contract import Generation, Prompt
from batch_assets.pipeline.openai_batch.protocol import CHAT_URL

# HTTP statuses of a request the provider refused for what it holds: resending it cannot help.
REFUSED_STATUSES = frozenset({400, 404, 413, 422})
# "line 12", "Line 12:", "on line 12" in a provider's message about an input file (OpenAI's
# `errors.data[].line` when given is used first).
_LINE = re.compile(r"\bline[ :#]*(\d+)\b", re.IGNORECASE)


@dataclass(frozen=True)
class RequestLine:
    custom_id: str
    line: bytes  # the JSON line, newline included


def request_lines(
    bodies: Sequence[dict], url: str = CHAT_URL, keys: Sequence[str | None] | None = None
) -> list[RequestLine]:
    """One batch line per request body. `keys`: each request's name, the same in every run (its
    `request_key`, which holds the row when identical prompts are not deduplicated), hashed with the
    body, so identical bodies of different rows keep their ids whichever of them a re-run still
    sends; identical (body, key) pairs get ids that differ by their rank in the stream."""
    seen: dict[str, int] = {}
    lines = []
    for body, key in zip(bodies, keys or [None] * len(bodies), strict=True):
        text = json.dumps(body, sort_keys=True, ensure_ascii=False) + ("" if key is None else f"\x00{key}")
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
        rank = seen.get(digest, 0)
        seen[digest] = rank + 1
        custom_id = f"ba-{digest}-{rank}"
        line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        lines.append(RequestLine(custom_id, (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")))
    return lines


def chat_body(prompt: Prompt, params: dict) -> dict:
    """A chat request's body: the messages and the request fields (`extra_body` merged in, as the
    client would send it)."""
    assert prompt.messages is not None  # the engine refuses prompts without messages first
    fields = {key: value for key, value in params.items() if key != "extra_body"}
    return {**fields, **params.get("extra_body", {}), "messages": list(prompt.messages)}


def split_files(lines: Sequence[RequestLine], max_requests: int, max_bytes: int) -> Iterator[list[RequestLine]]:
    """The lines cut into files of at most `max_requests` lines and `max_bytes` bytes, in order. A
    single line over `max_bytes` raises ValueError (no provider would take it)."""
    current: list[RequestLine] = []
    size = 0
    for line in lines:
        if len(line.line) > max_bytes:
            raise ValueError(
                f"one request is {len(line.line):,} bytes as a batch line, more than engine.max_bytes_per_file "
                f"({max_bytes:,})"
            )
        if current and (len(current) >= max_requests or size + len(line.line) > max_bytes):
            yield current
            current, size = [], 0
        current.append(line)
        size += len(line.line)
    if current:
        yield current


@dataclass(frozen=True)
class Answer:
    """What a batch said of one request: a generation, or an error and whether resending may help."""

    generation: Generation | None = None
    error: str | None = None
    retryable: bool = False


@dataclass
class AnswerCounts:
    """What a provider's output and error files said that does not add up, counted (the metadata
    of inference_outputs): each kind settled by `settle_answers` and counted, never silently."""

    conflicts: int = 0  # requests answered more than once with different content: `batch_conflict` rows
    repeated: int = 0  # answers repeated with the same content (or the same request failed twice): one kept
    errors_overridden: int = 0  # failures (error file, non-200) of requests also answered 200: the 200 kept
    unknown_ids: int = 0  # lines naming a `custom_id` the batch never held: ignored
    unreadable_lines: int = 0  # lines that are not JSON objects with a `custom_id`: ignored

    def add(self, other: AnswerCounts) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def metadata(self) -> dict[str, int]:
        return {
            "batch_answer_conflicts": self.conflicts,
            "batch_answers_repeated": self.repeated,
            "batch_errors_overridden": self.errors_overridden,
            "batch_unknown_ids": self.unknown_ids,
            "batch_unreadable_lines": self.unreadable_lines,
        }

    def summary(self) -> str:
        """The counts that are not zero, as a log line says them ("" when all are)."""
        return ", ".join(
            f"{key.removeprefix('batch_').replace('_', ' ')}: {n}" for key, n in self.metadata().items() if n
        )


def answer_lines(data: bytes, counts: AnswerCounts) -> Iterator[tuple[str, Answer]]:
    """An output or error file's lines as (`custom_id`, answer), in file order; a line without a
    `custom_id` (not JSON, cut off) has nothing to match it to: counted, skipped."""
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        if not isinstance(custom_id, str):
            counts.unreadable_lines += 1
            continue
        yield custom_id, _answer(record)


def settle_answers(files: Sequence[bytes], ids: Collection[str], counts: AnswerCounts) -> dict[str, Answer]:
    """One answer per request of a batch (`ids`) that its files (output first, then errors) mention;
    a request they do not mention is left for the caller to account for. Contradictions are
    settled and counted in `counts`: a 200 answer wins over failures of the same request (a paid
    answer is never thrown away), the same answer twice is one, different answers are a
    `batch_conflict` error row (which of them is right cannot be told)."""
    by_id: dict[str, list[Answer]] = {}
    for data in files:
        for custom_id, answer in answer_lines(data, counts):
            if custom_id in ids:
                by_id.setdefault(custom_id, []).append(answer)
            else:
                counts.unknown_ids += 1
    return {custom_id: _settled(answers, counts) for custom_id, answers in by_id.items()}


def _settled(answers: list[Answer], counts: AnswerCounts) -> Answer:
    answered = [a for a in answers if a.generation is not None]
    if not answered:
        counts.repeated += len(answers) - 1
        return answers[0]
    counts.errors_overridden += len(answers) - len(answered)
    texts = list(dict.fromkeys((a.generation.text, a.generation.finish_reason) for a in answered if a.generation))
    if len(texts) == 1:
        counts.repeated += len(answered) - 1
        return answered[0]
    counts.conflicts += 1
    shown = ", ".join(repr((text or "")[:40]) for text, _ in texts)
    return Answer(
        error=(
            f"batch_conflict: the provider answered this request {len(answered)} times with different content "
            f"({shown}); none of them is kept"
        )[:300]
    )


def _answer(record: dict) -> Answer:
    response = record.get("response") or {}
    error = record.get("error")
    status = response.get("status_code") if isinstance(response, dict) else None
    body = response.get("body") if isinstance(response, dict) else None
    if isinstance(body, str):  # OGX's reference provider sends the body as a JSON string
        try:
            body = json.loads(body)
        except ValueError:
            body = {"error": {"message": body[:200]}}
    if status == 200 and isinstance(body, dict) and not error:
        try:
            return Answer(generation=_chat_generation(body))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return Answer(error=f"batch_error: unreadable response ({type(exc).__name__}: {exc})"[:300])
    message = _message(error) or _message(body.get("error") if isinstance(body, dict) else None) or "no detail"
    code = f"HTTP {status}" if status else (error.get("code") if isinstance(error, dict) else None) or "failed"
    return Answer(
        error=f"batch_error: {code}: {message}"[:300],
        retryable=status not in REFUSED_STATUSES,
    )


def _message(error: object) -> str | None:
    if isinstance(error, dict):
        text = error.get("message")
        return " ".join(str(text).split())[:200] if text else None
    return " ".join(str(error).split())[:200] if error else None


def _chat_generation(body: dict) -> Generation:
    choice = body["choices"][0]
    text = choice["message"]["content"]
    if text is None:
        raise ValueError("the response has no message content")
    usage = body.get("usage") or {}
    tokens = (choice.get("logprobs") or {}).get("content") or []
    logprob = (
        float(sum(token["logprob"] for token in tokens))
        if tokens and all(token.get("logprob") is not None for token in tokens)
        else None
    )
    return Generation(
        text=text,
        finish_reason=choice.get("finish_reason"),
        num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
        num_generated_tokens=int(usage.get("completion_tokens") or 0),
        cumulative_logprob=logprob,
        token_logprobs=token_logprobs_text(tokens),
    )


def refused_lines(errors: object, message: str = "") -> set[int]:
    """The 1-based line numbers a provider named when it refused an input file: from a batch's
    `errors.data[].line`, else from the words of its message."""
    lines = {
        int(entry.line)
        for entry in (getattr(errors, "data", None) or [])
        if getattr(entry, "line", None) is not None and int(entry.line) > 0
    }
    if not lines:
        lines = {int(match) for match in _LINE.findall(message) if int(match) > 0}
    return lines
