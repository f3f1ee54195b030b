"""The component types of batch_assets: a task as a Dagster component (`TaskComponent`, whose
attributes are the task's fields) and a folder of task YAML files (`TaskPipelinesComponent`).

Both build, per task, the four partitioned assets, their checks, the task's job and drops sensor
(`task_definitions.component_definitions`). `dg` finds them as `batch_assets.TaskComponent` and
`batch_assets.TaskPipelinesComponent` (the `dagster_dg_cli.registry_modules` entry point).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import dagster as dg
import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from batch_assets.lib.task_definitions import component_definitions
from batch_assets.pipeline.task_spec import (
    BUNDLED_TASKS_DIR,
    TASK_NAME_PATTERN,
    SettingError,
    TaskLoad,
    TaskSpec,
    load_tasks,
    tasks_dir,
)

# Dagster renders templates in every string with Jinja's native types, which reads a plain "1" as
# the number 1 and "None" as None (a task's `choices: ["1", "2"]` would stop being strings): only
# strings that hold a template are rendered here.
_TEMPLATE_MARKS = ("{{", "{%")
# What a validation error shows of the value: nothing (an API key pasted by mistake must not reach logs).
NOT_SHOWN = "(not shown)"


def _render_templates(value: Any, loc: tuple[str | int, ...], errors: list[InitErrorDetails]) -> Any:
    """`value` with its `{{ ... }}` templates rendered in Dagster's scope (`env`, `dg`, `datetime`);
    a template that fails becomes an error at its own key."""
    if isinstance(value, dict):
        return {key: _render_templates(item, (*loc, key), errors) for key, item in value.items()}
    if isinstance(value, list):
        return [_render_templates(item, (*loc, index), errors) for index, item in enumerate(value)]
    if not isinstance(value, str) or not any(mark in value for mark in _TEMPLATE_MARKS):
        return value
    try:
        return dg.ResolutionContext.default().resolve_value(value)
    except Exception as exc:  # Dagster's ResolutionException, or Jinja's for a malformed template
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        why = ValueError(f"template could not be rendered: {lines[-1]}")
        errors.append(InitErrorDetails(type="value_error", loc=loc, input=NOT_SHOWN, ctx={"error": why}))
        return value


def _located(exc: ValidationError) -> ValidationError:
    """The task's validation errors at the setting each names: a rule over several settings
    (`SettingError`) points at its own key, so Dagster shows that line of defs.yaml. Values are not
    echoed, as `TaskSpec` does."""
    errors = []
    for error in exc.errors(include_url=False, include_input=False):
        cause = (error.get("ctx") or {}).get("error")
        key = cause.key if isinstance(cause, SettingError) else ()
        # Dagster rebuilds the errors by type, with their context: both are kept.
        located = InitErrorDetails(type=error["type"], loc=(*error["loc"], *key), input=NOT_SHOWN)
        if "ctx" in error:
            located["ctx"] = error["ctx"]
        errors.append(located)
    return ValidationError.from_exception_data(exc.title, errors)


class TaskAttributes(TaskSpec):
    """A task's settings: the attributes of a `batch_assets.TaskComponent`, the fields of a task YAML file.

    String settings may hold Dagster templates, e.g. `model: "{{ env('MODEL') }}"`."""

    @model_validator(mode="wrap")
    @classmethod
    def _templates_rendered_errors_located(cls, raw: Any, handler: Any) -> Any:
        # Dagster validates attributes first and renders templates afterwards (at resolution); the
        # task's rules can only judge rendered values, so templates render here, in the default scope.
        errors: list[InitErrorDetails] = []
        rendered = _render_templates(raw, (), errors)
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        try:
            return handler(rendered)
        except ValidationError as exc:
            raise _located(exc) from None


class TaskScaffoldParams(BaseModel):
    like: str = Field(default="sentiment", description="The bundled task the new task starts as a copy of.")


class TaskScaffolder(dg.Scaffolder[TaskScaffoldParams]):
    """`dg scaffold defs batch_assets.TaskComponent <name>`: a defs.yaml holding a copy of a bundled
    task (`--json-params '{"like": "industry"}'`, default `sentiment`) named after its folder."""

    @classmethod
    def get_scaffold_params(cls) -> type[TaskScaffoldParams]:
        return TaskScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[TaskScaffoldParams]) -> None:
        name = request.target_path.name
        if not TASK_NAME_PATTERN.match(name):
            raise ValueError(f"{name!r} cannot name a task: the folder name must match {TASK_NAME_PATTERN.pattern}")
        like = BUNDLED_TASKS_DIR / f"{request.params.like}.yaml"
        if not like.is_file():
            bundled = ", ".join(sorted(path.stem for path in BUNDLED_TASKS_DIR.glob("*.yaml")))
            raise ValueError(f"like: {request.params.like!r} is no bundled task; one of {bundled}")
        text = like.read_text(encoding="utf-8")
        if request.scaffold_format != "yaml" or request.append:
            dg.scaffold_component(request, {"name": name, **yaml.safe_load(text)})
            return
        # The bundled file as it is, indented under `attributes`: Dagster's own writer
        # (`dg.scaffold_component`) dumps the values again and drops the comments that explain them.
        attributes = textwrap.indent(f"name: {name}\n{text}", "  ", lambda line: bool(line.strip()))
        header = f"type: {request.type_name}\n\n# A copy of the bundled task {like.stem!r}: edit it.\nattributes:\n"
        (request.target_path / "defs.yaml").write_text(header + attributes, encoding="utf-8")


class PipelineComponent(dg.Component):
    """What our component types share: the sensor of the whole code location (runs of dead
    `batch-assets` processes, stranded pool steps) comes with the first of them in the tree."""

    def carries_location_sensors(self, context: dg.ComponentLoadContext) -> bool:
        tree = context.component_tree
        ours = [*tree.get_all_components(TaskPipelinesComponent), *tree.get_all_components(TaskComponent)]
        return not ours or ours[0] is self


@dg.scaffold_with(TaskScaffolder)
class TaskComponent(PipelineComponent, dg.Resolvable):
    """One batch-inference task (asset group, checks, job, drops sensor): the attributes are the
    task's fields, those of a task YAML file (`TaskSpec`)."""

    def __init__(self, task: TaskSpec, defined_in: Path | None = None):
        self.task = task
        # The defs.yaml the task's attributes were read from (None: built in Python), for messages.
        self.defined_in = defined_in

    @classmethod
    def model(cls) -> type[BaseModel]:
        # The schema `dg` validates defs.yaml with and shows editors is the task file's own.
        return TaskAttributes

    @classmethod
    def resolve_from_model(cls, context: dg.ResolutionContext, model: Any) -> TaskComponent:
        # Validated (templates rendered) as the attributes were read: the same task, as a TaskSpec.
        positions = context.source_position_tree
        defined_in = Path(positions.position.filename) if positions is not None else None
        return cls(TaskSpec.model_construct(model.model_fields_set, **dict(model)), defined_in)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return component_definitions(
            [self.task],
            range_failure_sensor=f"{self.task.name}_range_failure_sensor",
            recovery_sensor=self.carries_location_sensors(context),
        )


class TaskPipelinesComponent(PipelineComponent, dg.Model, dg.Resolvable):
    """One batch-inference pipeline (asset group, checks, job, drops sensor) per task YAML file.

    Task files keep their own format (YAML 1.2 booleans, strict keys); errors name the file and,
    where it can be found, the line. A bad file becomes a failing sensor and the others load."""

    tasks_dir: str | None = Field(
        default=None,
        description=(
            "Folder of task YAML files, relative to this component's defs.yaml or absolute. "
            "Unset: BATCH_ASSETS_TASKS_DIR, else the tasks bundled with batch_assets."
        ),
    )
    # What the last `build_defs` loaded, and from where: `batch-assets` reads a project's tasks here
    # (app/projects.py).
    _loaded: TaskLoad | None = PrivateAttr(default=None)
    _loaded_from: Path | None = PrivateAttr(default=None)

    @property
    def loaded_tasks(self) -> TaskLoad:
        if self._loaded is None:
            raise RuntimeError("the component's definitions are not built yet: its tasks are read then")
        return self._loaded

    def task_file(self, name: str) -> Path:
        """The file of one of the loaded tasks (`.yaml` or `.yml`: `load_tasks` refuses both at once)."""
        folder = self._loaded_from or tasks_dir()
        yml = folder / f"{name}.yml"
        return yml if yml.is_file() else folder / f"{name}.yaml"

    def resolved_tasks_dir(self, component_path: Path) -> Path:
        if self.tasks_dir is None:
            return tasks_dir()
        folder = Path(self.tasks_dir).expanduser()
        return folder if folder.is_absolute() else (component_path / folder).resolve()

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        self._loaded_from = self.resolved_tasks_dir(context.path)
        loaded = self._loaded = load_tasks(self._loaded_from)
        return component_definitions(
            loaded.tasks, task_errors=loaded.errors, recovery_sensor=self.carries_location_sensors(context)
        )
