"""Cost and budget of a partition: an estimate before inference, the actual figure after.

The estimate counts what the engine would be sent: the prompt tokens of every row without an
error (rows with an error never reach the engine) and, at worst, `sampling.max_tokens` generated
tokens per such row. Deduplication and the result cache can only lower the real figure, so a
partition within its budget by this estimate stays within it. Pure functions, no Dagster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from batch_assets.pipeline.prices import cost_usd, engine_price
from batch_assets.pipeline.task_spec import BudgetSpec, PriceSpec

if TYPE_CHECKING:  # a type only: the contract imports the pipeline's stages, budget none of them
    from batch_assets.pipeline.formats import TaskFormat


@dataclass(frozen=True)
class CostEstimate:
    rows_to_infer: int
    prompt_tokens: int
    max_generated_tokens: int  # worst case: every row runs to sampling.max_tokens
    # None when the task has no engine.price; a batch API's at its batch price (`batch_price_factor`).
    cost_usd: float | None

    def metadata(self) -> dict[str, int | float]:
        values: dict[str, int | float] = {
            "estimated_prompt_tokens": self.prompt_tokens,
            "estimated_max_generated_tokens": self.max_generated_tokens,
        }
        if self.cost_usd is not None:
            values["estimated_max_cost_usd"] = self.cost_usd
        return values


def estimate_cost(formatted: pl.DataFrame, fmt: TaskFormat) -> CostEstimate:
    """The worst-case cost of inferring a partition of `formatted_prompts` (the tokens it may
    generate are its kind's: `TaskFormat.max_generated_tokens`)."""
    task = fmt.task
    to_infer = formatted.filter(pl.col("error").is_null())
    prompt_tokens = int(to_infer["num_prompt_tokens"].sum() or 0)
    generated = fmt.max_generated_tokens(to_infer)
    return CostEstimate(
        to_infer.height, prompt_tokens, generated, cost_usd(prompt_tokens, generated, engine_price(task.engine))
    )


def budget_overruns(estimate: CostEstimate, budget: BudgetSpec | None) -> list[str]:
    """One sentence per limit the estimate exceeds (empty: within budget), naming both figures."""
    if budget is None:
        return []
    overruns = []
    if budget.max_prompt_tokens is not None and estimate.prompt_tokens > budget.max_prompt_tokens:
        overruns.append(
            f"prompt tokens {estimate.prompt_tokens:,} exceed budget.max_prompt_tokens {budget.max_prompt_tokens:,}"
        )
    if budget.max_generated_tokens is not None and estimate.max_generated_tokens > budget.max_generated_tokens:
        overruns.append(
            f"worst-case generated tokens {estimate.max_generated_tokens:,} ({estimate.rows_to_infer:,} rows x "
            f"sampling.max_tokens) exceed budget.max_generated_tokens {budget.max_generated_tokens:,}"
        )
    if budget.max_cost_usd is not None and estimate.cost_usd is not None and estimate.cost_usd > budget.max_cost_usd:
        overruns.append(
            f"worst-case cost ${estimate.cost_usd:,.4f} exceeds budget.max_cost_usd ${budget.max_cost_usd:,.4f}"
        )
    return overruns


def actual_cost_metadata(prompt_tokens: int, generated_tokens: int, price: PriceSpec | None) -> dict:
    """`inference_outputs` metadata: what the partition's outputs cost at `price`, from the same token
    counts as its `prompt_tokens` / `generated_tokens` metadata (rows reused from the cache or a
    checkpoint were paid for once, by the run that inferred them). Empty without a price."""
    cost = cost_usd(prompt_tokens, generated_tokens, price)
    return {} if cost is None else {"cost_usd": cost}
