"""The task YAML: one file per use of the pipeline, validated into a `TaskSpec`.

A task says which input field(s) to read, how to turn them into a chat prompt, which model and
engine settings to use, how to sample, and what shape the output must have. Everything the asset
factory builds for a task (asset group, partitions, drop zone, sensor, checks) comes from here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from .base import SettingError, TaskSpecError
from .checks import BudgetSpec
from .engine import EMBEDDED_EMBEDDING_MODEL, EMBEDDED_MODEL, EngineSpec, PriceSpec, check_base_url, check_vllm_args
from .lora import LoraSpec, ResolvedLora, base_model_problem, engine_lora_rank, resolve_lora
from .model_folders import EMBEDDED_MODEL_LIMITS
from .output import OutputSpec, SamplingSpec, schema_error
from .prompt import DEFAULT_RAW_EXAMPLE_TEMPLATE, example_answer_text
from .runs import CacheSpec
from .spec import TASK_NAME_PATTERN, TaskSpec, max_model_len_problem
from .yaml_file import line_of, parse_yaml, problems, read_task_file

log = logging.getLogger(__name__)

TASKS_DIR_ENV = "BATCH_ASSETS_TASKS_DIR"
BUNDLED_TASKS_DIR = Path(__file__).resolve().parents[2] / "tasks"


def load_task_spec(path: Path) -> TaskSpec:
    try:
        text = read_task_file(path)
        raw, document = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise TaskSpecError(f"{path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise TaskSpecError(f"{path}: not valid YAML: nested too deeply for a task file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskSpecError(f"{path}: cannot be read: {exc}") from exc
    if raw is None:
        raise TaskSpecError(f"{path}: empty: a task file is a mapping of settings (input, prompt, output, ...)")
    if not isinstance(raw, dict):
        raise TaskSpecError(
            f"{path}: line 1: expected a mapping of settings (input, prompt, output, ...) at the top level, "
            f"not a {type(raw).__name__}"
        )
    raw.setdefault("name", path.stem)
    try:
        spec = TaskSpec.model_validate(raw)
    except ValidationError as exc:
        raise TaskSpecError(f"{path}: {problems(exc, document, TaskSpec)}") from None
    except ValueError as exc:
        raise TaskSpecError(f"{path}: {exc}") from exc
    if spec.name != path.stem:
        line = line_of(document, ("name",))
        raise TaskSpecError(
            f"{path}: name (line {line}): task name {spec.name!r} must equal the file name {path.stem!r}"
        )
    return spec


def tasks_dir() -> Path:
    return Path(os.environ.get(TASKS_DIR_ENV) or BUNDLED_TASKS_DIR)


@dataclass(frozen=True)
class TaskFileError:
    """A task file (or two files claiming one task name) that could not be loaded."""

    name: str  # the task the file(s) would define: the file name without its suffix
    paths: tuple[Path, ...]
    message: str  # names the file(s), the field and the rule


@dataclass(frozen=True)
class TaskLoad:
    tasks: list[TaskSpec]
    errors: list[TaskFileError]


def load_tasks(directory: Path | None = None) -> TaskLoad:
    """Every `*.yaml` / `*.yml` task in the tasks folder, sorted by name, and the files that failed.

    One broken file does not hide the others: the good tasks load and each bad file becomes a
    `TaskFileError` (the code location shows it as a failing sensor, `batch-assets tasks` prints it).
    Two files for one task name (`x.yaml` next to `x.yml`) are refused together, naming both.
    """
    directory = directory or tasks_dir()
    paths = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    if not paths:
        raise TaskSpecError(f"no task YAML files in {directory}")
    by_name: dict[str, list[Path]] = {}
    for path in paths:
        by_name.setdefault(path.stem, []).append(path)
    tasks: list[TaskSpec] = []
    errors: list[TaskFileError] = []
    for name, group in sorted(by_name.items()):
        if len(group) > 1:
            files = " and ".join(str(path) for path in group)
            message = f"{files} both define the task {name!r}: keep one of them (rename or remove the other)"
            errors.append(TaskFileError(name, tuple(group), message))
            continue
        try:
            tasks.append(load_task_spec(group[0]))
        except TaskSpecError as exc:
            errors.append(TaskFileError(name, (group[0],), str(exc)))
        except Exception as exc:
            # A check that fails unexpectedly (a bug, or a library error no check turned into a
            # message) must not take the other tasks down; it is logged with its traceback and
            # the file is reported as not loaded, like any other bad file.
            log.exception("task file %s could not be loaded", group[0])
            message = f"{group[0]}: could not be loaded: {type(exc).__name__}: {exc}"
            errors.append(TaskFileError(name, (group[0],), message))
    return TaskLoad(tasks, errors)


def load_task_specs(directory: Path | None = None) -> list[TaskSpec]:
    """Every task in the tasks folder, sorted by name; any bad file raises `TaskSpecError` naming it."""
    loaded = load_tasks(directory)
    if loaded.errors:
        raise TaskSpecError("\n".join(error.message for error in loaded.errors))
    return loaded.tasks


# What the rest of batch_assets imports from here; the other names live in their section's module.
__all__ = [
    "BUNDLED_TASKS_DIR",
    "BudgetSpec",
    "CacheSpec",
    "DEFAULT_RAW_EXAMPLE_TEMPLATE",
    "EMBEDDED_EMBEDDING_MODEL",
    "EMBEDDED_MODEL",
    "EMBEDDED_MODEL_LIMITS",
    "EngineSpec",
    "LoraSpec",
    "OutputSpec",
    "PriceSpec",
    "ResolvedLora",
    "SamplingSpec",
    "SettingError",
    "TASKS_DIR_ENV",
    "TASK_NAME_PATTERN",
    "TaskFileError",
    "TaskLoad",
    "TaskSpec",
    "TaskSpecError",
    "base_model_problem",
    "check_base_url",
    "check_vllm_args",
    "engine_lora_rank",
    "example_answer_text",
    "load_task_spec",
    "load_task_specs",
    "load_tasks",
    "max_model_len_problem",
    "resolve_lora",
    "schema_error",
    "tasks_dir",
]
