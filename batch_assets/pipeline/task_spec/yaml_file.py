"""Reading a task file: YAML 1.2 booleans, duplicate keys and alias bombs refused, and pydantic's
errors given as `setting (line N): rule`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

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


def problems(exc: ValidationError, document: yaml.Node | None) -> str:
    """Pydantic's errors as `field (line N): rule` (no input values, no documentation links)."""
    return "; ".join(_problem(error, document) for error in exc.errors(include_url=False, include_input=False))


def _problem(error: Any, document: yaml.Node | None) -> str:
    cause = (error.get("ctx") or {}).get("error")
    located = cause if isinstance(cause, SettingError) else SettingError("")
    loc = (*error["loc"], *located.key)
    where = ".".join(str(part) for part in loc)
    message = str(error["msg"]).removeprefix("Value error, ")
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
