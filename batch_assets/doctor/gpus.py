"""GPUs as NVIDIA's management library (NVML, through nvidia-ml-py, which vLLM's CUDA build brings)
sees them, and whether the driver is new enough for the CUDA that torch was built with.

torch only says "no GPU" when the driver is missing, not loaded or too old, and the engine then
starts on the CPU defaults; NVML says which of these it is. `probe_nvml` asks NVML (nothing else
touches the GPU), `gpu_decision` turns its answer into the line, so the decision is tested on
recorded answers where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batch_assets.doctor.report import Check, fail, ok, skip, warn

if TYPE_CHECKING:
    from batch_assets.doctor.context import DoctorContext

NAME = "gpus"
# NVML's return codes (nvml.h, `nvmlReturn_t`); nvidia-ml-py raises NVMLError with `.value` one of them.
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
# The oldest Linux driver branch of each CUDA major version (NVIDIA's CUDA Toolkit release notes,
# "CUDA Toolkit and Minimum Required Driver Version"): 12.x needs 525, 13.x needs 580.
MIN_DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}
# The CUDA of the `gpu` extra (vllm 0.32.0, torch 2.13.0) and of deploy/Dockerfile's base image,
# for a machine whose torch cannot be asked.
PINNED_CUDA_MAJOR = 13
PINNED_VLLM = "vLLM 0.32"
DRIVER_SETTING = "the GPU node's NVIDIA driver"
# Set by K8sRunLauncher in every run pod (dagster_k8s/job.py): doctor runs in a run pod, where a GPU is due.
RUN_POD_ENV = "DAGSTER_RUN_JOB_NAME"


@dataclass(frozen=True)
class NvmlProbe:
    installed: bool = True  # nvidia-ml-py importable
    error_code: int | None = None  # NVML's return code when nvmlInit failed
    driver: str | None = None  # "580.65.06"
    cuda: int | None = None  # nvmlSystemGetCudaDriverVersion: 13000 is CUDA 13.0
    devices: tuple[str, ...] = ()


def probe_nvml() -> NvmlProbe:
    try:
        import pynvml
    except ImportError:
        return NvmlProbe(installed=False)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return NvmlProbe(error_code=int(error.value))
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(pynvml.nvmlDeviceGetCount())]
        return NvmlProbe(
            driver=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda=int(pynvml.nvmlSystemGetCudaDriverVersion()),
            devices=tuple(_text(pynvml.nvmlDeviceGetName(handle)) for handle in handles),
        )
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def torch_cuda_major() -> int | None:
    """The CUDA major version torch was built with; None for a CPU build; the pinned one without torch."""
    try:
        import torch
    except ImportError:
        return PINNED_CUDA_MAJOR
    built = torch.version.cuda
    return int(built.split(".")[0]) if built else None


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
    if probe.error_code == NVML_ERROR_DRIVER_NOT_LOADED:
        detail = (
            "the NVIDIA driver is not loaded (NVML: Driver Not Loaded): torch sees no GPU, the engine would use the CPU"
        )
        return missing(NAME, detail, f"{DRIVER_SETTING} (load its kernel module)")
    if probe.error_code == NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        detail = "the NVIDIA driver's library and kernel module differ (updated without a reboot): torch sees no GPU"
        return missing(NAME, detail, f"{DRIVER_SETTING} (reboot the node)")
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
    driver_cuda = f"{probe.cuda // 1000}.{probe.cuda % 1000 // 10}" if probe.cuda else "unknown"
    seen = f"{len(probe.devices)} GPU(s) ({kinds}), driver {probe.driver} (CUDA {driver_cuda})"
    if cuda_major is None:
        return warn(
            NAME,
            f"{seen}, but torch is a CPU build: the engine would not use them",
            "install the `gpu` extra (vLLM with CUDA)",
        )
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    driver_major = int((probe.driver or "0").split(".")[0] or 0)
    too_old = (probe.cuda is not None and probe.cuda // 1000 < cuda_major) or (need is not None and driver_major < need)
    if too_old:
        who = PINNED_VLLM if cuda_major == PINNED_CUDA_MAJOR else f"CUDA {cuda_major}"
        minimum = f">= {need}" if need else f"a driver for CUDA {cuda_major}"
        return fail(
            NAME,
            f"driver {probe.driver} (CUDA {driver_cuda}) is too old for CUDA {cuda_major} ({who} needs {minimum}): "
            "torch would see no GPU and the engine would run on the CPU",
            f"{DRIVER_SETTING}: {minimum}",
        )
    return ok(NAME, f"{seen}, enough for CUDA {cuda_major}")


def check_gpus(ctx: DoctorContext) -> Iterator[Check]:
    probe = probe_nvml()
    ctx.visible_gpus = len(probe.devices) if probe.installed and probe.error_code is None else None
    yield gpu_decision(probe, torch_cuda_major(), gpu_expected(ctx.env))
