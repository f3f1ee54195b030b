"""GPUs as NVIDIA's management library (NVML, through nvidia-ml-py, which vLLM's CUDA build brings)
sees them, and whether the driver is new enough for the CUDA that torch was built with.

torch only says "no GPU" when the driver is missing, not loaded or too old; NVML says which of these
it is. `probe_nvml` asks NVML (nothing else touches the GPU) and `driver_problem` turns its answer
into what is wrong and what to change, tested on recorded answers where there is no GPU. The
engine's count of GPUs (`cuda_device_count`, what torch can use) fails a run with these words where
a CUDA build of torch sees no GPU that NVML sees, instead of starting on the CPU defaults;
`batch-assets doctor` prints the same words.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from batch_assets.pipeline.engine_contract import EngineStartError

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


def driver_problem(probe: NvmlProbe, cuda_major: int | None) -> tuple[str, str] | None:
    """(what is wrong, the setting to change) when NVIDIA hardware is there but CUDA cannot use it:
    the driver not loaded, its library and kernel module apart, or too old for torch's CUDA. None
    otherwise (no NVIDIA driver at all, no NVML, or a driver that fits)."""
    if probe.error_code == NVML_ERROR_DRIVER_NOT_LOADED:
        return (
            "the NVIDIA driver is not loaded (NVML: Driver Not Loaded): torch sees no GPU, "
            "the engine would use the CPU",
            f"{DRIVER_SETTING} (load its kernel module)",
        )
    if probe.error_code == NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "the NVIDIA driver's library and kernel module differ (updated without a reboot): torch sees no GPU",
            f"{DRIVER_SETTING} (reboot the node)",
        )
    if probe.error_code is not None or not probe.devices or cuda_major is None:
        return None
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    driver_major = int((probe.driver or "0").split(".")[0] or 0)
    if not ((probe.cuda is not None and probe.cuda // 1000 < cuda_major) or (need is not None and driver_major < need)):
        return None
    who = PINNED_VLLM if cuda_major == PINNED_CUDA_MAJOR else f"CUDA {cuda_major}"
    minimum = f">= {need}" if need else f"a driver for CUDA {cuda_major}"
    return (
        f"driver {probe.driver} (CUDA {driver_cuda(probe)}) is too old for CUDA {cuda_major} ({who} needs {minimum}): "
        "torch would see no GPU and the engine would run on the CPU",
        f"{DRIVER_SETTING}: {minimum}",
    )


def driver_cuda(probe: NvmlProbe) -> str:
    return f"{probe.cuda // 1000}.{probe.cuda % 1000 // 10}" if probe.cuda else "unknown"


def cuda_device_count() -> int:
    """The GPUs torch can use. A CUDA build of torch that sees none where NVML sees NVIDIA hardware
    (a driver too old, not loaded, or updated without a reboot) fails the run with the reason and the
    setting, the words of `batch-assets doctor`, instead of starting on the CPU defaults."""
    try:
        if _cpu_build_of_torch():
            return 0
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        cuda_build = torch.version.cuda is not None
    except Exception:  # torch missing or broken: treat as CPU
        return 0
    problem = gpu_unusable(probe_nvml(), torch_cuda_major()) if cuda_build else None
    if problem:
        raise EngineStartError(problem)
    return 0


def _cpu_build_of_torch() -> bool:
    """Whether the installed torch is built for CPUs only (neither CUDA nor ROCm), read from its
    `version.py` without importing torch: the import takes seconds of every run's fixed cost, and
    a run on a CPU whose engine never starts (a zero-cost engine, every row cached) needs no torch."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return not (loaded.version.cuda or loaded.version.hip)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False  # no torch: the caller's import says so
    version = runpy.run_path(str(Path(spec.submodule_search_locations[0]) / "version.py"))
    return not (version.get("cuda") or version.get("hip"))


def gpu_unusable(probe: NvmlProbe, cuda_major: int | None) -> str | None:
    problem = driver_problem(probe, cuda_major)
    return f"{problem[0]}; set: {problem[1]}" if problem else None
