"""What tokens cost at a task's `engine.price`: the budget's estimate and actual cost
(pipeline/budget.py) and a cascade's cost against its teacher on every row (pipeline/cascade/run.py),
whose chat teacher's tokens are at `output.cascade.teacher_price` (`engine.price` is the embedding
model's)."""

from __future__ import annotations

from batch_assets.pipeline.task_spec import EngineSpec, PriceSpec, TaskSpec
from batch_assets.pipeline.task_spec.batch_api import BATCH_API_KIND

MILLION = 1_000_000


def engine_price(spec: EngineSpec) -> PriceSpec | None:
    """The price a task's tokens cost: `engine.price`, times `batch_price_factor` for a batch API."""
    return _on_engine(spec.price, spec)


def teacher_price(task: TaskSpec) -> PriceSpec | None:
    """The price a cascade's chat teacher's tokens cost: `output.cascade.teacher_price`, times
    `batch_price_factor` where the teacher runs on a batch API (the task's engine kind)."""
    cascade = task.output.cascade
    return _on_engine(cascade.teacher_price if cascade is not None else None, task.engine)


def _on_engine(price: PriceSpec | None, spec: EngineSpec) -> PriceSpec | None:
    if price is None or spec.kind != BATCH_API_KIND:
        return price
    factor = spec.batch_price_factor
    return price.model_copy(
        update={
            "input_per_million_tokens": price.input_per_million_tokens * factor,
            "output_per_million_tokens": price.output_per_million_tokens * factor,
        }
    )


def cost_usd(prompt_tokens: int, generated_tokens: int, price: PriceSpec | None) -> float | None:
    """Dollars for these token counts at `price`; None without a price, or with only a GPU-hour price
    (`per_gpu_hour`: the in-process engine's time is what costs, not its tokens)."""
    if price is None or not tokens_priced(price):
        return None
    return round(
        prompt_tokens * price.input_per_million_tokens / MILLION
        + generated_tokens * price.output_per_million_tokens / MILLION,
        6,
    )


def tokens_priced(price: PriceSpec) -> bool:
    """Whether `price` prices tokens: a token price set, or no GPU-hour price instead (a price of zero
    per token is a free endpoint, whose cost is $0)."""
    return bool(price.input_per_million_tokens or price.output_per_million_tokens) or price.per_gpu_hour is None


def gpu_cost_usd(gpu_hours: float, price: PriceSpec | None) -> float | None:
    """Dollars for this much engine time at `engine.price.per_gpu_hour`; None without that price."""
    if price is None or price.per_gpu_hour is None:
        return None
    return round(gpu_hours * price.per_gpu_hour, 6)
