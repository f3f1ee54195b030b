"""How a run's step waits for a pool slot (the `gpu` pool): asleep, and taking a freed slot within seconds.

Range runs of one burst meet in the `gpu` pool: the second run's `inference_outputs` waits while the
first run's engine works. Two defects of Dagster 1.13's in-process executor make that wait costly,
and every run that waits behind another pays them:

- It never sleeps while a step waits. `InstanceConcurrencyContext.interval_to_next_pending_claim_check`
  returns `min([0, ...])`, never more than 0, so the run worker polls in a loop and takes a whole
  core for as long as the wait lasts (144 CPU s in a measured burst of 20 drops, on a 2-core
  machine whose other run was working its engine).
- Between two looks at the pool it backs off exponentially up to 15 s, so a freed slot was taken
  8.8 s late in the same burst, time added straight to the burst's wall.

`sleep_between_pool_checks()` makes the executor sleep until its next look and caps the gap between
looks at `POOL_CHECK_SECONDS` (a look is one small query of the instance's database). It replaces
two private members of Dagster's module (there is no setting for either); the test of this module
fails if a Dagster upgrade renames them or changes what they mean.
"""

from __future__ import annotations

import time

# How late a waiting step may notice a freed slot, at most: one database query per waiting run per period.
POOL_CHECK_SECONDS = 2.0
_applied = False


def sleep_between_pool_checks() -> None:
    """Idempotent; applies to every run executed in this process (a run worker loads the definitions
    before it executes anything, `batch-assets run` builds them too)."""
    global _applied
    if _applied:
        return
    from batch_assets.runtime.dagster_private import instance_concurrency_context as module

    context_class = module.InstanceConcurrencyContext
    dagster_backoff = module._calculate_timeout_interval

    def next_check_in(self) -> float:
        # Seconds until the earliest waiting step may look again: the executor sleeps that long.
        if not self._pending_claims:
            return 0.0
        now = time.time()
        return max(0.0, min((ready_at - now for ready_at in self._pending_timeouts.values()), default=0.0))

    def capped_backoff(sleep_interval: float | None, pending_claim_count: int) -> float:
        return min(POOL_CHECK_SECONDS, dagster_backoff(sleep_interval, pending_claim_count))

    context_class.interval_to_next_pending_claim_check = next_check_in  # type: ignore[method-assign]
    module._calculate_timeout_interval = capped_backoff
    _applied = True
