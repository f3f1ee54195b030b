"""One line per check: `OK|WARN|FAIL|SKIP  <check>: <detail> [set: <setting>]`.

FAIL: a first run would fail (or misbehave) until the setting is changed; the exit status is 1.
WARN: worth a look, not a failure. SKIP: does not apply here, and the line says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["OK", "WARN", "FAIL", "SKIP"]


@dataclass(frozen=True)
class Check:
    status: Status
    name: str
    detail: str
    setting: str | None = None  # what to change; named with every FAIL and WARN

    def line(self) -> str:
        where = f" [set: {self.setting}]" if self.setting else ""
        return f"{self.status:<4}  {self.name}: {self.detail}{where}"


def ok(name: str, detail: str) -> Check:
    return Check("OK", name, detail)


def skip(name: str, why: str) -> Check:
    return Check("SKIP", name, why)


def warn(name: str, detail: str, setting: str) -> Check:
    return Check("WARN", name, detail, setting)


def fail(name: str, detail: str, setting: str) -> Check:
    return Check("FAIL", name, detail, setting)


def exit_status(checks: list[Check]) -> int:
    return 1 if any(check.status == "FAIL" for check in checks) else 0


def summary(checks: list[Check]) -> str:
    counts = {status: sum(check.status == status for check in checks) for status in ("OK", "WARN", "FAIL", "SKIP")}
    verdict = "a first run would fail: fix the FAIL lines" if counts["FAIL"] else "ready for a first run"
    return f"{verdict} ({', '.join(f'{n} {status}' for status, n in counts.items() if n)})"
