"""A cascade's test material: embeddings scattered around one centre per class, a teacher that is
always right, the frames the inference loop hands a cascade, and a cascade task file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from batch_assets.pipeline.cascade.run import TeacherAnswer
from batch_assets.pipeline.result_stores import encode_vector
from batch_assets.pipeline.task_spec.cascade import CascadeSpec, ColumnTeacher

CHOICES = ["alpha", "beta", "gamma", "delta"]


def blobs(rows: int, *, noise: float, seed: int = 0, classes: int = 4, dim: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors scattered around one random centre per class; the class of each."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim))
    y = rng.integers(0, classes, rows)
    x = centres[y] + rng.normal(scale=noise, size=(rows, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), y


def perfect_teacher(y: np.ndarray, asked: list[int] | None = None):
    def teach(positions: np.ndarray) -> list[TeacherAnswer]:
        if asked is not None:
            asked.extend(int(i) for i in positions)
        return [TeacherAnswer(CHOICES[y[i]]) for i in positions]

    return teach


def spec(**settings) -> CascadeSpec:
    return CascadeSpec(teacher=ColumnTeacher(column="gold"), **settings)


def embedded_results(x: np.ndarray, gold: list[str | None], errors: dict[int, str] | None = None) -> pl.DataFrame:
    """What the inference loop hands an embedding kind: encoded vectors in `generated_text`."""
    errors = errors or {}
    rows = len(gold)
    return pl.DataFrame(
        {
            "row_id": list(range(rows)),
            "source_line": [i + 2 for i in range(rows)],
            "name": [f"row {i}" for i in range(rows)],
            "gold": gold,
            "prompt": [f"row {i}" for i in range(rows)],
            "generated_text": [None if i in errors else encode_vector(x[i]) for i in range(rows)],
            "finish_reason": [None if i in errors else "stop" for i in range(rows)],
            "num_prompt_tokens": [3] * rows,
            "num_generated_tokens": [0] * rows,
            "cumulative_logprob": [None] * rows,
            "error": [errors.get(i) for i in range(rows)],
        },
        schema_overrides={"cumulative_logprob": pl.Float64, "error": pl.String, "generated_text": pl.String},
    )


def cascade_task_yaml(sample_rows: int, audit_rows: int, rest: str) -> str:
    """A cascade task file over `name`, its column teacher `gold`, then the sections in `rest`."""
    return f"""
input: {{text_fields: [name]}}
prompt: {{template: "{{name}}"}}
output:
  kind: choices
  method: cascade
  choices: [alpha, beta, gamma, delta]
  cascade: {{teacher: {{column: gold}}, sample_rows: {sample_rows}, audit_rows: {audit_rows}}}
{rest}"""


CASCADE_TASK = cascade_task_yaml(150, 30, "checks: {gold_field: gold, min_agreement: 0.9}\n")


def write(tmp_path: Path, body: str, name: str = "cascaded") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(body)
    return path
