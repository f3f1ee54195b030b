"""Each endpoint task's server (`engine.kind: openai` or `batch_api`): whether the variable its
`engine.api_key_env` names is set here, and whether `engine.base_url` answers `GET /models` (with
that key, as a run sends it), as the storage check writes to S3. One line per task; the key's value
is never shown. The engine's resources may set `base_url` or the key in code, which doctor cannot
see: a task file without `base_url` is a WARN, not a FAIL."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.report import Check, fail, ok, warn
from batch_assets.pipeline.task_spec import TaskSpec
from batch_assets.storage.errors import scrub

ENDPOINT_KINDS = ("openai", "batch_api")
# A server that does not answer within this is as good as down for a first run.
PROBE_TIMEOUT_S = 5.0
# Statuses of a server that turned the key away (or wants one).
REFUSED = (401, 403)


@dataclass(frozen=True)
class Probe:
    status: int | None  # the HTTP status of GET /models; None when the server did not answer
    cause: str = ""  # why it did not answer


def check_endpoints(ctx: DoctorContext) -> Iterator[Check]:
    probes: dict[tuple[str, str | None], Probe] = {}
    for task in ctx.tasks.tasks:
        if task.engine.kind in ENDPOINT_KINDS:
            yield endpoint_check(task, ctx.env, probes)


def endpoint_check(task: TaskSpec, env: Mapping[str, str], probes: dict[tuple[str, str | None], Probe]) -> Check:
    """The task's line; `probes`: the answers of servers asked already, by (URL, key variable)."""
    name, url, key_env = f"endpoint {task.name}", task.engine.base_url, task.engine.api_key_env
    url_setting = f"engine.base_url in the task file of {task.name!r}"
    if not url:
        return warn(name, "no engine.base_url: a run fails unless the engine's resource sets `base_url`", url_setting)
    url = url.rstrip("/")
    key = env.get(key_env) if key_env else None
    if (url, key_env) not in probes:
        probes[(url, key_env)] = probe(url, key)
    answer = probes[(url, key_env)]
    problems: list[tuple[str, str]] = []  # (what is wrong, the setting to change)
    if key_env and not key:
        problems.append((f"engine.api_key_env names {key_env}, which is not set here", key_env))
    if answer.status is None:
        problems.append((f"{url} does not answer (GET /models: {answer.cause})", url_setting))
    elif answer.status in REFUSED and key:
        problems.append((f"{url} refuses the key in {key_env} (GET /models: HTTP {answer.status})", str(key_env)))
    elif answer.status in REFUSED and not key_env:
        problems.append(
            (f"{url} asks for a key (GET /models: HTTP {answer.status})", f"engine.api_key_env of {task.name!r}")
        )
    if problems:
        return fail(name, "; and ".join(what for what, _ in problems), "; ".join(where for _, where in problems))
    if answer.status is not None and answer.status >= 500:
        return warn(name, f"{url} answers with a server error (GET /models: HTTP {answer.status})", url_setting)
    with_key = f" with the key in {key_env}" if key_env else " (no engine.api_key_env: requests carry no key)"
    return ok(name, f"{url} answers{with_key} (GET /models: HTTP {answer.status})")


def probe(base_url: str, key: str | None) -> Probe:
    """`GET <base_url>/models`, as the OpenAI client sends it; any HTTP status means the server answers."""
    request = urllib.request.Request(f"{base_url}/models")
    if key:
        # Not sent on to where a redirect points (urllib re-sends a request's other headers there).
        request.add_unredirected_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
            return Probe(response.status)
    except urllib.error.HTTPError as error:
        return Probe(error.code)
    except urllib.error.URLError as error:
        return Probe(None, scrub(str(error.reason)))
    except (OSError, ValueError) as error:  # a timeout while reading, a URL urllib cannot open
        return Probe(None, scrub(str(error) or type(error).__name__))
