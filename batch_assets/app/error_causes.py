"""The one line a user reads when something failed: the outermost error batch_assets raised itself.

Our exceptions (`StorageError`, `EngineStartError`, `DropFileError`, ...) say what failed, where
(file, URL with the password hidden) and which setting to change; the library exception they were
raised from is only the symptom ("Is the server running on that host…?" from the database driver
of the result cache). So the chain, Dagster's (`SerializableErrorInfo.cause`/`.context`) or
Python's (`__cause__`/`__context__`), is walked from the outside in, and the first error whose
class is defined in batch_assets is shown whole, on one line; a chain without one shows its
innermost error's last line, as before. Credentials never appear (`scrub`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from batch_assets.storage.errors import exception_chain, scrub

if TYPE_CHECKING:
    from batch_assets.runtime.dagster_private import SerializableErrorInfo

PACKAGE = "batch_assets"
# Dagster keeps an exception as `traceback.format_exception_only` wrote it: `module.Class: message`.
_OURS_PREFIX = re.compile(rf"^{PACKAGE}(?:\.[A-Za-z_]\w*)+(?::[ \t]?|\n|$)")
_FAILURE_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)*Failure: ?")
_DOCS_LINK = "For further information visit"


def is_ours(error: BaseException) -> bool:
    return type(error).__module__.split(".")[0] == PACKAGE


def error_line(error: BaseException) -> str:
    """One line for a Python exception: its outermost own cause, else its text (with the class name
    unless it is an `OSError`, whose text says what it is)."""
    ours = next((cause for cause in exception_chain(error) if is_ours(cause)), None)
    if ours is not None:
        return scrub(one_line(str(ours)) or type(ours).__name__)
    if not str(error):
        return type(error).__name__
    kind = "" if isinstance(error, OSError) else f"{type(error).__name__}: "
    return scrub(f"{kind}{meaningful_line(str(error))}")


def error_info_line(error: SerializableErrorInfo) -> str:
    """One line for an error Dagster recorded: its outermost own cause, else the innermost error's
    meaningful line."""
    chain = list(error_info_chain(error))
    for info in chain:
        # A `dg.Failure` of this code location is ours too: its description says what happened
        # ("stopped (interrupted)" over the engine error the interrupt caused).
        prefix = _OURS_PREFIX.match(info.message) or (
            info.cls_name == "Failure" and _FAILURE_PREFIX.match(info.message)
        )
        if prefix:
            return scrub(one_line(info.message[prefix.end() :]) or info.cls_name or "error")
    return scrub(meaningful_line(chain[-1].message))


def error_info_chain(error: SerializableErrorInfo) -> Iterator[SerializableErrorInfo]:
    """Dagster's record of an error, then of its cause (or the error being handled), outermost first."""
    current: SerializableErrorInfo | None = error
    while current is not None:
        yield current
        current = current.cause or current.context


def one_line(message: str) -> str:
    """A message of several lines (a library's reason inside ours, a hint on its own line) as one."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line and not line.startswith(_DOCS_LINK))


def meaningful_line(message: str) -> str:
    """The line of an error message that says what is wrong (not a documentation link)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(_DOCS_LINK)]
    for line in lines:
        if line.startswith("Value error, "):
            return line.removeprefix("Value error, ")
    return lines[-1] if lines else "unknown error"
