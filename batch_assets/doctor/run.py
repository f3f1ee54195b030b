"""The checks of `batch-assets doctor`, in order (later ones use what earlier ones found: the
instance, the GPUs NVML sees), and the run that prints their lines as they come."""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from batch_assets.app.error_causes import error_line
from batch_assets.app.projects import BUNDLED, TaskSource
from batch_assets.doctor.cluster import check_service_account
from batch_assets.doctor.context import DoctorContext
from batch_assets.doctor.endpoints import check_endpoints
from batch_assets.doctor.extras import check_extras
from batch_assets.doctor.gpus import check_gpus
from batch_assets.doctor.instance_checks import check_instance_storage, check_run_launcher, check_run_pod_env
from batch_assets.doctor.models import check_models, check_tasks
from batch_assets.doctor.pools import check_gpu_pool
from batch_assets.doctor.ray_cluster import check_ray_cluster
from batch_assets.doctor.report import Check, exit_status, fail, summary
from batch_assets.doctor.storage_checks import check_locations, check_result_cache
from batch_assets.runtime.instance import home_path

CheckFunction = Callable[[DoctorContext], Iterable[Check]]
CHECKS: list[tuple[str, CheckFunction]] = [
    ("instance storage", check_instance_storage),
    ("run launcher", check_run_launcher),
    ("run pod environment", check_run_pod_env),
    ("ray cluster", check_ray_cluster),
    ("tasks", check_tasks),
    ("extras", check_extras),
    ("gpus", check_gpus),
    ("gpu pool", check_gpu_pool),
    ("models", check_models),
    ("endpoints", check_endpoints),
    ("storage locations", check_locations),
    ("result cache", check_result_cache),
    ("service account", check_service_account),
]


def run_doctor(say: Callable[[str], None], *, verbose: bool = False, source: TaskSource = BUNDLED) -> int:
    """Every check's lines through `say`, then a summary; 1 when any check failed, else 0. `verbose`:
    a check that could not run prints its traceback too. `source`: whose tasks are checked."""
    context = DoctorContext(home=home_path(), source=source)
    results: list[Check] = []
    with _quiet_libraries():
        try:
            for name, check in CHECKS:
                for result in _run_one(name, check, context, verbose):
                    say(result.line())
                    results.append(result)
        finally:
            context.close()
    say(summary(results))
    return exit_status(results)


def _run_one(name: str, check: CheckFunction, context: DoctorContext, verbose: bool) -> Iterator[Check]:
    try:
        yield from check(context)
    except Exception as error:  # noqa: BLE001 - one check's own failure must not hide the others
        if verbose:
            traceback.print_exc()
        yield fail(name, f"could not be checked: {error_line(error)}", "see `batch-assets doctor --verbose`")


@contextmanager
def _quiet_libraries() -> Iterator[None]:
    """The libraries' warnings (Dagster's retries of a Postgres connection, deprecations) stay out of
    the check lines: each line says what failed and the setting to change."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
