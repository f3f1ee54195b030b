"""The cascade against its targets, with a column teacher (the gold label: a perfect teacher).

    .venv/bin/python bench/bench_cascade.py --rows 20000     # the measurement in BENCHMARKS.md
    .venv/bin/python bench/bench_cascade.py --rows 2000      # a smoke run
    .venv/bin/python bench/bench_cascade.py --rows 2000 --chat-teacher   # the embedded chat model teaches

1. Generates `--rows` labelled company names (bench/generate_industries.py; 10 % with no cue to their
   industry; none of the shipped sample's names).
2. (a) `batch-assets run` of an embedding task on them and (b) `batch-assets run` of the cascade task
   (`output.method: cascade`, teacher = the `Industry` column, defaults otherwise), each a new process
   in a fresh DAGSTER_HOME and data folder (no result cache): whole-run speed is (a)'s wall / (b)'s.
3. On (a)'s vectors, the cascade core (pipeline/cascade/run.py, the code (b) runs, same seeds) for three
   settings of `defer_below`: accuracy against gold, teacher share, audit agreement and its 95 %
   interval, the student's cross-validated agreement, and the cascade's own seconds.

Targets (issue 39): accuracy >= 0.95 x the teacher's (1.0 here) with the teacher on <= 25 % of rows,
and whole-run speed >= 0.8 x embedding alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from generate_industries import generate, write_csv  # noqa: E402

from batch_assets.pipeline.cascade.run import TeacherAnswer, run_cascade  # noqa: E402
from batch_assets.pipeline.cascade.summary import wilson_interval  # noqa: E402
from batch_assets.pipeline.result_stores import vectors_matrix  # noqa: E402
from batch_assets.pipeline.task_spec.cascade import CascadeSpec, ColumnTeacher  # noqa: E402
from batch_assets.storage.drop_files import partition_key_for  # noqa: E402

VENV_BIN = Path(sys.executable).parent
SAMPLE = HERE.parent / "batch_assets" / "samples" / "industry_cascade" / "companies.csv"
CHOICES = ["Law Firm", "Healthcare", "Technology", "Retail", "Consulting", "Manufacturing", "Finance", "Real Estate"]
CHOICES.append("Other")
EMBED_TASK = """
input: {text_fields: [Company]}
prompt: {template: "{Company}"}
engine: {max_model_len: 256, vllm_args: {dtype: float32}}
output: {kind: embedding}
"""
CASCADE_TASK = f"""
input: {{text_fields: [Company]}}
prompt: {{template: "{{Company}}"}}
engine: {{max_model_len: 256, vllm_args: {{dtype: float32}}}}
output:
  kind: choices
  method: cascade
  choices: {CHOICES}
  cascade: {{teacher: {{column: Industry}}}}
checks: {{gold_field: Industry}}
"""
# `--chat-teacher`: the embedded chat model as the teacher, with the industry_fewshot example's system
# prompt and one example per label (none of them in the generated set's names).
FEW_SHOT = [
    ("Whitfield & Marsh Attorneys", "Law Firm"),
    ("Quantum Byte Labs Inc.", "Technology"),
    ("Sunset Travel Agency", "Other"),
    ("Riverside Pediatric Associates", "Healthcare"),
    ("First Harbor Credit Union", "Finance"),
    ("Maple Street Boutique", "Retail"),
    ("Oakmont Realty Partners", "Real Estate"),
    ("Ironclad Steel Fabrication Ltd.", "Manufacturing"),
    ("Bridgewater Strategy Advisors", "Consulting"),
]
CHAT_TEACHER_TASK = f"""
input: {{text_fields: [Company]}}
prompt:
  system: >-
    You are a helpful assistant that infers company industries. Based on the company name
    provided, output only the industry category. Choose from: {", ".join(CHOICES)}.
  template: "{{Company}}"
  examples:
{"".join(f"    - {{input: {{Company: '{name}'}}, answer: '{label}'}}" + chr(10) for name, label in FEW_SHOT)}
engine: {{max_model_len: 256, vllm_args: {{dtype: float32}}}}
sampling: {{temperature: 0, max_tokens: 16}}
output:
  kind: choices
  method: cascade
  choices: {CHOICES}
  cascade: {{teacher: llm}}
checks: {{gold_field: Industry}}
"""
DEFER_SETTINGS = (0.4, 0.6, 0.8)


def run_task(task: str, csv_path: Path, work: Path, tasks_dir: Path) -> tuple[float, Path]:
    env = {
        **os.environ,
        "DAGSTER_HOME": str(work / "home"),
        "BATCH_ASSETS_DATA": str(work / "data"),
        "BATCH_ASSETS_TASKS_DIR": str(tasks_dir),
    }
    (work / "home").mkdir(parents=True)
    started = time.perf_counter()
    done = subprocess.run(
        [str(VENV_BIN / "batch-assets"), "run", task, str(csv_path)], env=env, cwd=work, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(
            f"batch-assets run {task} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
        )
    labels = work / "data" / "storage" / task / "validated_labels" / f"{partition_key_for(csv_path.name)}.parquet"
    return wall, labels


def core_row(vectors: np.ndarray, gold: list[str], defer_below: float) -> dict:
    def teacher(positions: np.ndarray) -> list[TeacherAnswer]:
        return [TeacherAnswer(gold[i]) for i in positions]

    started = time.perf_counter()
    result = run_cascade(
        vectors, teacher, CascadeSpec(teacher=ColumnTeacher(column="Industry"), defer_below=defer_below), CHOICES
    )
    seconds = time.perf_counter() - started
    labels = np.array(result.labels, dtype=object)
    truth = np.array(gold, dtype=object)
    by_teacher = np.array([by == "teacher" for by in result.labelled_by])
    audit = [i for i, role in enumerate(result.roles) if role == "audit"]
    agreed = sum(result.student_labels[i] == result.labels[i] for i in audit)
    low, high = wilson_interval(agreed, len(audit))
    return {
        "defer_below": defer_below,
        "accuracy": float((labels == truth).mean()),
        "student_accuracy": float((labels[~by_teacher] == truth[~by_teacher]).mean()),
        "teacher_share": float(by_teacher.mean()),
        "audit": f"{agreed}/{len(audit)} = {agreed / max(len(audit), 1):.3f} [{low:.3f}, {high:.3f}]",
        "cv_agreement": result.student.cv_agreement,
        "over_budget": result.over_budget_rows,
        "seconds": seconds,
    }


def generated_set(rows: int, no_cue_share: float, work: Path) -> Path:
    exclude = {row["Company"] for row in pl.read_csv(SAMPLE).iter_rows(named=True)} | {name for name, _ in FEW_SHOT}
    csv_path = work / "companies.csv"
    write_csv(generate(rows, seed=1, no_cue_share=no_cue_share, exclude=exclude), csv_path)
    return csv_path


def chat_teacher(rows: int, no_cue_share: float) -> None:
    """The cascade with the embedded chat model as teacher: its agreement with the student on the
    audit rows, its share, and both against gold, whatever they are."""
    with tempfile.TemporaryDirectory(prefix="bench_cascade_chat_") as tmp:
        work = Path(tmp)
        csv_path = generated_set(rows, no_cue_share, work)
        tasks = work / "tasks"
        tasks.mkdir()
        (tasks / "bench_cascade_chat.yaml").write_text(CHAT_TEACHER_TASK)
        print(f"{rows} rows, {no_cue_share:.0%} without a cue; teacher = embedded:SmolLM2-135M-Instruct, 9 examples")
        wall, labels_path = run_task("bench_cascade_chat", csv_path, work / "chat", tasks)
        labels = pl.read_parquet(labels_path)
        ok = labels.filter(pl.col("error").is_null())
        teacher = ok.filter(pl.col("labelled_by") == "teacher")
        audit = ok.filter(pl.col("cascade_role") == "audit")
        agreed = int((audit["student_label"] == audit["label"]).sum())
        low, high = wilson_interval(agreed, audit.height)
        print(f"batch-assets run, cascade with a chat teacher: {wall:.1f} s wall")
        share = float((labels["labelled_by"] == "teacher").mean() or 0.0)
        print(f"teacher share {share:.4f}, error rows {labels.height - ok.height}")
        print(f"audit: student agrees with the teacher on {agreed}/{audit.height} [{low:.3f}, {high:.3f}]")
        print(
            f"accuracy vs gold: all labels {float((ok['label'] == ok['Industry']).mean() or 0.0):.4f}, "
            f"the teacher's own labels {float((teacher['label'] == teacher['Industry']).mean() or 0.0):.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--no-cue-share", type=float, default=0.1)
    parser.add_argument(
        "--chat-teacher",
        action="store_true",
        help="the embedded chat model (few-shot) as the teacher, not the gold column",
    )
    args = parser.parse_args()
    if args.chat_teacher:
        chat_teacher(args.rows, args.no_cue_share)
        return
    with tempfile.TemporaryDirectory(prefix="bench_cascade_") as tmp:
        work = Path(tmp)
        csv_path = generated_set(args.rows, args.no_cue_share, work)
        tasks = work / "tasks"
        tasks.mkdir()
        (tasks / "bench_embed.yaml").write_text(EMBED_TASK)
        (tasks / "bench_cascade.yaml").write_text(CASCADE_TASK)
        print(f"{args.rows} rows, {args.no_cue_share:.0%} without a cue to their industry; teacher = the gold column")
        embed_wall, embed_labels = run_task("bench_embed", csv_path, work / "embed", tasks)
        cascade_wall, cascade_labels = run_task("bench_cascade", csv_path, work / "cascade", tasks)
        print(f"(a) batch-assets run, embedding only:  {embed_wall:7.1f} s wall")
        print(f"(b) batch-assets run, cascade:         {cascade_wall:7.1f} s wall")
        speed = embed_wall / cascade_wall
        print(f"whole-run speed (a)/(b): {speed:.3f}  (target >= 0.8: {'met' if speed >= 0.8 else 'NOT met'})")
        labelled = pl.read_parquet(cascade_labels)
        gold = labelled["Industry"]
        teacher_share = float((labelled["labelled_by"] == "teacher").mean() or 0.0)
        accuracy = float((labelled["label"] == gold).mean() or 0.0)
        print(f"(b) labels: accuracy vs gold {accuracy:.4f}, teacher share {teacher_share:.4f}")
        vectors_frame = pl.read_parquet(embed_labels)
        vectors = vectors_matrix(vectors_frame["embedding"])
        gold_list = vectors_frame["Industry"].to_list()
        print("\nthe cascade core on (a)'s vectors (teacher accuracy 1.0; target accuracy >= 0.95, teacher <= 25 %):")
        print(
            f"{'defer_below':>11} {'accuracy':>9} {'student acc':>11} {'teacher':>8} {'over budget':>11} {'cv agr':>7} "
            f"{'seconds':>8}  audit agreement [95 %]"
        )
        for defer_below in DEFER_SETTINGS:
            row = core_row(vectors, gold_list, defer_below)
            met = row["accuracy"] >= 0.95 and row["teacher_share"] <= 0.25
            print(
                f"{row['defer_below']:>11} {row['accuracy']:>9.4f} {row['student_accuracy']:>11.4f} "
                f"{row['teacher_share']:>8.3f} {row['over_budget']:>11} {row['cv_agreement']:>7.3f} "
                f"{row['seconds']:>8.2f}  {row['audit']}  {'met' if met else 'NOT met'}"
            )


if __name__ == "__main__":
    main()
