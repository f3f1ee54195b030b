"""The settings of `engine.kind: batch_api` (a provider's OpenAI-compatible Batch API) and its price.

A `batch_api` task sends its requests as batch files (`/v1/files` + `/v1/batches`) instead of one
request at a time: the provider runs them within `completion_window` at a discount. The fields are
declared here and sit on the task's `engine:` (`task_spec.EngineSpec`) next to the endpoint's
`base_url`, `api_key_env` and `model`, which a batch API uses as an endpoint does:

    completion_window      the provider's deadline for a batch; OpenAI takes only "24h"
    poll_seconds           how often a waiting run asks for its batches' status
    max_requests_per_file  requests per uploaded file at most (OpenAI: 50,000)
    max_bytes_per_file     bytes per uploaded file at most (OpenAI: 200 MB)
    resubmit_failed        requests that failed, expired or were cancelled in a batch are sent
                           once more in a new batch before they become error rows
    expiry_grace_seconds   how long past a batch's `expires_at` a run waits for the provider to
                           end it before the run cancels it (and again for the cancel to land);
                           its requests left then are `batch_expired` error rows
    batch_price_factor     what a batch costs as a share of `engine.price` (0.5: half price, as at
                           OpenAI, Anthropic, Together, Groq, Mistral); estimates, budgets and
                           `cost_usd` use it (`prices.engine_price`)

None of them changes an output (code versions leave them out: pipeline/code_versions.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

BATCH_API_KIND = "batch_api"
# OpenAI's limits per input file (https://platform.openai.com/docs/guides/batch).
OPENAI_MAX_REQUESTS_PER_FILE = 50_000
OPENAI_MAX_BYTES_PER_FILE = 200 * 1024 * 1024

CompletionWindow = Literal["24h"]
PollSeconds = Annotated[float, Field(ge=0.05, le=3600, allow_inf_nan=False)]
RequestsPerFile = Annotated[int, Field(ge=1, le=OPENAI_MAX_REQUESTS_PER_FILE)]
# At least one large request's line (64 KiB); at most OpenAI's limit.
BytesPerFile = Annotated[int, Field(ge=64 * 1024, le=OPENAI_MAX_BYTES_PER_FILE)]
# A provider's clock, and its move of a batch to "expired", may lag: an hour by default; a week at most.
GraceSeconds = Annotated[float, Field(ge=0, le=7 * 24 * 3600, allow_inf_nan=False)]
PriceFactor = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]

# The engine fields above: they decide how requests travel, never what comes back.
BATCH_API_FIELDS = frozenset(
    {
        "completion_window",
        "poll_seconds",
        "max_requests_per_file",
        "max_bytes_per_file",
        "resubmit_failed",
        "expiry_grace_seconds",
        "batch_price_factor",
    }
)
