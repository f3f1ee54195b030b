"""What every section of a task file shares: the strict model base, the error that knows its
setting's key (so a message can give its line), and the largest count a setting may hold."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# The largest count a setting may hold: vLLM and torch keep token counts and positions as int32,
# so anything beyond is a typo that would fail only at inference.
MAX_COUNT = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SettingError(ValueError):
    """A refused setting that knows its key, so the error can give the key's line in the task file.

    `key` is relative to the model whose validator raises it (pydantic prefixes that model's own
    location); `related` are other settings the message names, as dotted paths from the top of the
    file, whose lines are given where the message names them.
    """

    def __init__(self, message: str, key: tuple[str | int, ...] = (), related: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key
        self.related = related


class TaskSpecError(ValueError):
    pass
