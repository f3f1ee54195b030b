"""vLLM 0.32 names batch_assets uses that vLLM neither exports from `vllm` nor documents.

Imported lazily (by the engine, once it starts), since importing vLLM imports torch.
- `UsageContext.LLM_CLASS`: the usage context `LLM(...)` passes to its engine; with it `AsyncLLM`
  picks the offline-batch step budgets for the device (`AsyncLLM.from_engine_args(...,
  usage_context=...)`), as a hand-written `LLM` script gets.
- `EngineGenerateError`: what `AsyncLLM.generate` raises for a failed request; a `ValueError` as its
  `__cause__` means vLLM refused that request (a grammar its backend cannot compile), which becomes
  the row's error instead of the run's failure.
- `VLLMClientError`: vLLM's error for a request it refuses outright.
- `LoRARequest`: the adapter a request carries (`engine.lora`); vLLM's LoRA docs import it from
  `vllm.lora.request`, not from `vllm`.
"""

from __future__ import annotations

from vllm.exceptions import VLLMClientError
from vllm.lora.request import LoRARequest
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.exceptions import EngineGenerateError

__all__ = ["EngineGenerateError", "LoRARequest", "UsageContext", "VLLMClientError"]
