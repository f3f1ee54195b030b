"""What several checks read once: the Dagster home and its dagster.yaml as written, the instance (loaded
by the storage check), the tasks, and whether this process runs in a Kubernetes pod."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from batch_assets.app.projects import BUNDLED, TaskSource

if TYPE_CHECKING:
    import dagster as dg

    from batch_assets.pipeline.task_spec import TaskLoad

K8S_LAUNCHER = "K8sRunLauncher"
# Set by Kubernetes in every container of a pod.
IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"


@dataclass
class DoctorContext:
    home: Path
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    instance: dg.DagsterInstance | None = None  # set by the storage check when the instance loads
    visible_gpus: int | None = None  # set by the GPU check when NVML answers
    source: TaskSource = BUNDLED  # whose tasks are checked: a dg project's, or the bundled ones
    # Where the storage check opened the instance of a home not made yet (removed by `close`).
    scratch_home: Path | None = None

    def close(self) -> None:
        """Dispose of the instance the checks opened, and of the scratch home it may live in."""
        if self.instance is not None:
            self.instance.dispose()
        if self.scratch_home is not None:
            shutil.rmtree(self.scratch_home, ignore_errors=True)

    @property
    def instance_file(self) -> Path:
        return self.home / "dagster.yaml"

    @cached_property
    def instance_config(self) -> dict[str, Any]:
        """dagster.yaml as written ({env: NAME} settings unresolved); {} when there is none."""
        if not self.instance_file.is_file():
            return {}
        return yaml.safe_load(self.instance_file.read_text()) or {}

    @property
    def launcher_section(self) -> dict[str, Any]:
        return self.instance_config.get("run_launcher") or {}

    @property
    def k8s_launcher(self) -> bool:
        return self.launcher_section.get("class") == K8S_LAUNCHER

    @property
    def in_cluster(self) -> bool:
        return bool(self.env.get(IN_CLUSTER_ENV))

    @cached_property
    def tasks(self) -> TaskLoad:
        return self.source.load_tasks()


def env_references(config: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(variable, setting path) of every `{env: NAME}` in a Dagster config, e.g.
    ("DAGSTER_PG_HOST", "storage.postgres.postgres_db.hostname")."""
    if isinstance(config, dict):
        if set(config) == {"env"} and isinstance(config["env"], str):
            yield config["env"], path
            return
        for key, value in config.items():
            yield from env_references(value, f"{path}.{key}" if path else str(key))
    elif isinstance(config, list):
        for index, value in enumerate(config):
            yield from env_references(value, f"{path}[{index}]")
