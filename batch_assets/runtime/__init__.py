"""Where batch_assets leans on Dagster's and vLLM's runtime beyond what they promise.

Every import of a private Dagster name (`dagster._...`) or of a vLLM name that vLLM neither exports
from `vllm` nor documents lives in `dagster_private.py` or `vllm_private.py`, each with what is
relied on; `batch_assets_tests/test_runtime_private.py` checks those shapes, so an upgrade that
changes them fails there, loudly, and not in production. The workarounds built on them sit here too:
how a step waiting for a pool slot sleeps and how slots are claimed one at a time (`pool_waits`),
runs of killed `batch-assets` processes and stranded pool steps (`run_recovery`), and the instance
created by one process at a time (`instance`).
"""
