"""Reading a task file: YAML 1.2 booleans, duplicate keys and alias bombs refused, and pydantic's
errors given as `setting (line N): rule`."""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .base import SettingError, TaskSpecError


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. PyYAML follows YAML 1.1, where `choices: [yes, no]` or a
    label `off` would silently become booleans. A key given twice in one mapping is refused: PyYAML
    would keep the last silently (a second `sampling:` section replacing the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        _refuse_duplicate_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode) -> None:
    first_seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden on purpose
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = first_seen.setdefault(key, key_node)
        except TypeError:  # an unhashable key: SafeLoader refuses it itself, with its line
            continue
        if first is not key_node:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} on line {first.start_mark.line + 1} and line {key_node.start_mark.line + 1}: "
                "keep one (YAML would silently use the last)",
                key_node.start_mark,
            )


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

# Task files are a few kilobytes; anything far larger is not a task file (or a link to a device).
MAX_TASK_FILE_BYTES = 1 << 20
# Values in a task file once YAML aliases are expanded: a few kilobytes of `&a [*b, *b, ...]` can
# stand for billions of values, which validation, code versions and run metadata would expand.
MAX_TASK_FILE_VALUES = 100_000


def parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The task file's data and its node tree (for the lines of keys), composed once."""
    loader = _Yaml12Loader(text)
    try:
        document = loader.get_single_node()
        if document is None:
            return None, None
        _expanded_size(document, {})
        return loader.construct_document(document), document
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for with aliases expanded (an alias is the node it names)."""
    if id(node) in sizes:
        return sizes[id(node)]
    children: list[yaml.Node] = []
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    size = 1 + sum(_expanded_size(child, sizes) for child in children)
    if size > MAX_TASK_FILE_VALUES:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"the value on line {node.start_mark.line + 1} expands (through YAML aliases) to more than "
            f"{MAX_TASK_FILE_VALUES} values; a task file is a few settings",
            node.start_mark,
        )
    sizes[id(node)] = size
    return size


def read_task_file(path: Path) -> str:
    if not path.is_file():
        raise TaskSpecError(f"{path}: not a regular file")
    with path.open("rb") as file:
        data = file.read(MAX_TASK_FILE_BYTES + 1)
    if len(data) > MAX_TASK_FILE_BYTES:
        raise TaskSpecError(f"{path}: larger than {MAX_TASK_FILE_BYTES // 1024} KiB; a task file is a few settings")
    return data.decode("utf-8")


def problems(exc: ValidationError, document: yaml.Node | None, model: type[BaseModel] | None = None) -> str:
    """Pydantic's errors as `field (line N): rule` (no input values, no documentation links); an
    unknown key of `model` (or of a section in it) with the closest valid names."""
    return "; ".join(_problem(error, document, model) for error in exc.errors(include_url=False, include_input=False))


def _problem(error: Any, document: yaml.Node | None, model: type[BaseModel] | None = None) -> str:
    cause = (error.get("ctx") or {}).get("error")
    located = cause if isinstance(cause, SettingError) else SettingError("")
    loc = (*error["loc"], *located.key)
    where = ".".join(str(part) for part in loc)
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden" and model is not None and loc:
        message += did_you_mean(str(loc[-1]), setting_names(model, loc[:-1]))
    line = line_of(document, loc)
    # A rule's own message that already names its setting needs the setting only once.
    if where and message.startswith(where + ": "):
        message = message[len(where) + 2 :]
    elif where and line and message.startswith(where + " "):
        where = f"line {line}"
        line = None
    for key in located.related:
        key_line = line_of(document, tuple(key.split(".")), exact=True)
        if key_line and key in message:
            message = message.replace(key, f"{key} (line {key_line})", 1)
    at = f"{where} (line {line})" if where and line else where
    return f"{at}: {message}" if at else message


def did_you_mean(name: str, valid: list[str]) -> str:
    """`; did you mean a, b?` with the valid names closest to a misspelt one (as `engine.vllm_args`
    suggests vLLM's); empty when none is close."""
    close = difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def setting_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the section at `loc` of a task file takes (`()`: the top level), from the models'
    fields; none where `loc` leads to no model (a free mapping such as `engine.vllm_args`)."""
    models = [model]
    for part in loc:
        if isinstance(part, int):
            continue  # an item of a list: its models are already the list's item models
        found = [m.model_fields[str(part)].annotation for m in models if str(part) in m.model_fields]
        if not found:
            continue  # a union member's tag in pydantic's location, not a key
        models = [m for annotation in found for m in _models_in(annotation)]
    return sorted({name for m in models for name in m.model_fields})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, the members of a union (`X | None`), the
    items of a list or the values of a dict."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    args = typing.get_args(annotation)
    if origin is dict:
        args = args[1:]
    elif origin is typing.Annotated:
        args = args[:1]
    elif origin not in (list, tuple, typing.Union, types.UnionType):
        return []
    return [m for arg in args for m in _models_in(arg)]


def line_of(document: yaml.Node | None, loc: tuple, *, exact: bool = False) -> int | None:
    """The 1-based line of the YAML key (or list item) a validation error's location points at;
    where the key is missing, the line of the nearest enclosing key (none if `exact`)."""
    node, line = document, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((key, value) for key, value in node.value if key.value == str(part)), None)
            if match is None:
                return None if exact else line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return None if exact else line
    return line
