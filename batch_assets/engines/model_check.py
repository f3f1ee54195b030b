"""Whether the task's model can be had, checked before anything is copied or run.

vLLM finds out late and says it badly: a model folder that does not exist, or a Hugging Face id on a
machine without a network, fails the run minutes later (after the engine began to start), and a DNS
failure alone takes about a minute. `check_model` answers in seconds, naming the setting to change.
Only the in-process vLLM engine loads a model here; an endpoint's model is the server's business.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from batch_assets.engines.embedded_model import EMBEDDED_PREFIX

if TYPE_CHECKING:
    from batch_assets.pipeline.engine_contract import ResolvedSettings


class ModelNotFound(Exception):
    """The task's model is neither a model folder nor a Hugging Face id this machine can load."""


def check_model(settings: ResolvedSettings) -> None:
    """Fail at once, naming the setting to change, when the model the engine resolved cannot be found."""
    model, setting = settings.model, settings.model_setting
    if settings.kind != "vllm" or model.startswith(EMBEDDED_PREFIX):
        return
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        if os.path.isdir(expanded) and not os.path.exists(os.path.join(expanded, "config.json")):
            raise ModelNotFound(f"model folder {expanded} has no config.json, so it is not a model; set {setting}")
        return
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise ModelNotFound(
            f"model folder {expanded} does not exist; set {setting} to a model folder or a Hugging Face id"
        )
    if _cached_on_hub(model):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise ModelNotFound(
            f"model {model!r} is not in the local Hugging Face cache and the Hub cannot be reached (offline); "
            f"download it where there is a network (`hf download {model}`), or set {setting} to a local folder"
        )


def _cached_on_hub(model: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers within `timeout` s (a DNS failure otherwise takes ~1 min)."""
    import socket
    import threading
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    reachable = threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
            reachable.set()
        except OSError:
            pass

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout)
    return reachable.is_set()
