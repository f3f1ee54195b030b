"""The GPU line of `batch-assets doctor`: NVML's answer (engines/gpu_probe.py, whose words a run
that meets the same driver problem fails with) and whether a GPU is due here (a run pod given GPUs).
`gpu_decision` is tested on recorded answers where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from batch_assets.doctor.report import Check, fail, ok, skip, warn
from batch_assets.engines.gpu_probe import (
    DRIVER_SETTING,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NvmlProbe,
    driver_cuda,
    driver_problem,
    probe_nvml,
    torch_cuda_major,
)

if TYPE_CHECKING:
    from batch_assets.doctor.context import DoctorContext

NAME = "gpus"
# Set by K8sRunLauncher in every run pod (dagster_k8s/job.py): doctor runs in a run pod, where a GPU is due.
RUN_POD_ENV = "DAGSTER_RUN_JOB_NAME"


def gpu_expected(env: Mapping[str, str]) -> bool:
    """A run pod that was given GPUs: missing ones fail its run (elsewhere, no GPU means the CPU)."""
    visible = env.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower()
    return bool(env.get(RUN_POD_ENV)) and visible not in ("", "void", "none")


def gpu_decision(probe: NvmlProbe, cuda_major: int | None, expected: bool) -> Check:
    """The GPU line for NVML's answer, the CUDA major torch needs (None: a CPU build) and whether a
    GPU is due here (a run pod given GPUs): without one, a missing GPU is a WARN or a SKIP."""
    missing = fail if expected else warn
    if not probe.installed:
        return skip(NAME, "nvidia-ml-py is not installed (vLLM's CUDA build brings it): GPUs not checked")
    if probe.error_code == NVML_ERROR_LIBRARY_NOT_FOUND:
        if expected:
            return fail(
                NAME,
                "no NVIDIA driver library (libnvidia-ml.so.1) in this run pod",
                f"{DRIVER_SETTING} and device plugin",
            )
        return skip(NAME, "no NVIDIA driver on this machine: the engine runs on the CPU here")
    problem = driver_problem(probe, cuda_major)
    if probe.error_code is not None and problem:
        return missing(NAME, *problem)
    if probe.error_code is not None:
        return missing(NAME, f"NVML does not start (error code {probe.error_code}): torch sees no GPU", DRIVER_SETTING)
    if not probe.devices:
        return missing(
            NAME, f"NVML sees no GPU (driver {probe.driver})", "the pod's nvidia.com/gpu limit, or CUDA_VISIBLE_DEVICES"
        )
    return _driver_decision(probe, cuda_major)


def _driver_decision(probe: NvmlProbe, cuda_major: int | None) -> Check:
    names = sorted(set(probe.devices))
    kinds = ", ".join(f"{name} ×{probe.devices.count(name)}" for name in names)
    seen = f"{len(probe.devices)} GPU(s) ({kinds}), driver {probe.driver} (CUDA {driver_cuda(probe)})"
    if cuda_major is None:
        return warn(
            NAME,
            f"{seen}, but torch is a CPU build: the engine would not use them",
            "install the `gpu` extra (vLLM with CUDA)",
        )
    problem = driver_problem(probe, cuda_major)
    if problem:
        return fail(NAME, *problem)
    return ok(NAME, f"{seen}, enough for CUDA {cuda_major}")


def check_gpus(ctx: DoctorContext) -> Iterator[Check]:
    probe = probe_nvml()
    ctx.visible_gpus = len(probe.devices) if probe.installed and probe.error_code is None else None
    yield gpu_decision(probe, torch_cuda_major(), gpu_expected(ctx.env))
