"""The cascade by target (`output.cascade.target`) on six generated files, with a perfect column teacher.

    .venv/bin/python bench/bench_cascade_target.py --alone               # the measurement in BENCHMARKS.md
    .venv/bin/python bench/bench_cascade_target.py --vectors DIR         # keep (or reuse) the embedded files

1. Generates six files of 5,000 labelled company names (bench/generate_industries.py, seeds 11-16, 12 %
   with no cue to their industry, none of the shipped sample's names).
2. Embeds them once, in one `batch-assets run` of an embedding task (the embedded all-MiniLM-L6-v2),
   one partition per file: the cascade's own first step, done once rather than once per setting.
3. On each file's vectors, the cascade core (pipeline/cascade/run.py, the code a cascade task's run calls)
   with `target: {agreement: 0.95, confidence: 0.95}` and the gold column as the teacher (SETTINGS for
   the rest), the files in order, each starting from the label model of the files before (every
   teacher label so far, as `<task>/label_model` holds them); with `--alone` also each file alone.
   Per file: accuracy against gold, teacher share, the chosen threshold, the guaranteed lower bound and
   the audit's estimate of the share of all rows agreeing, with its 95 % interval.

Targets (issue 52): at least 5 of the 6 files reach accuracy >= 0.95 and the median teacher share is
<= 0.20.
"""

from __future__ import annotations

import argparse
import os
import statistics
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

from bench_cascade import CHOICES, EMBED_TASK, SAMPLE  # noqa: E402
from generate_industries import generate, write_csv  # noqa: E402

from batch_assets.pipeline.cascade.run import TeacherAnswer, run_cascade  # noqa: E402
from batch_assets.pipeline.cascade.student import StoredStudent  # noqa: E402
from batch_assets.pipeline.cascade.summary import CascadeSummary  # noqa: E402
from batch_assets.pipeline.result_stores import vectors_matrix  # noqa: E402
from batch_assets.pipeline.task_spec.cascade import CascadeSpec, ColumnTeacher, TargetSpec  # noqa: E402
from batch_assets.storage.drop_files import partition_key_for  # noqa: E402

VENV_BIN = Path(sys.executable).parent
SEEDS = range(11, 17)
ROWS = 5000
NO_CUE_SHARE = 0.12
TARGET = TargetSpec(agreement=0.95, confidence=0.95)
# The cascade's settings here (the task's `output.cascade`), besides the target and the teacher.
SETTINGS = {"sample_rows": 600, "calibration_rows": 400, "audit_rows": 100, "max_teacher_share": 0.4}


def embedded_files(folder: Path) -> list[Path]:
    """The six files' embedded rows (`Company`, `Industry`, `embedding`), made once into `folder`."""
    wanted = [folder / f"companies_{seed}.parquet" for seed in SEEDS]
    if all(path.exists() for path in wanted):
        return wanted
    exclude = {row["Company"] for row in pl.read_csv(SAMPLE).iter_rows(named=True)}
    work = folder / "work"
    (work / "tasks").mkdir(parents=True, exist_ok=True)
    (work / "home").mkdir(exist_ok=True)
    (work / "tasks" / "bench_embed.yaml").write_text(EMBED_TASK)
    files = []
    for seed in SEEDS:
        csv_path = work / f"companies_{seed}.csv"
        write_csv(generate(ROWS, seed=seed, no_cue_share=NO_CUE_SHARE, exclude=exclude), csv_path)
        files.append(csv_path)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(work / "home"),
        "BATCH_ASSETS_DATA": str(work / "data"),
        "BATCH_ASSETS_TASKS_DIR": str(work / "tasks"),
    }
    started = time.perf_counter()
    done = subprocess.run(
        [str(VENV_BIN / "batch-assets"), "run", "bench_embed", *map(str, files)],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"batch-assets run bench_embed failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
        )
    print(f"embedded {len(files)} files of {ROWS} rows in {time.perf_counter() - started:.1f} s wall")
    for csv_path, path in zip(files, wanted, strict=True):
        labels = (
            work
            / "data"
            / "storage"
            / "bench_embed"
            / "validated_labels"
            / f"{partition_key_for(csv_path.name)}.parquet"
        )
        pl.read_parquet(labels).select("Company", "Industry", "embedding").write_parquet(path)
    return wanted


def file_row(path: Path, spec: CascadeSpec, stored: StoredStudent | None) -> tuple[dict, StoredStudent]:
    """One file through the cascade core (starting from `stored`, the label model of the files before,
    when given), and the label model with this file's teacher rows added (as `<task>/label_model`
    trains on every teacher label without an error)."""
    frame = pl.read_parquet(path)
    vectors = vectors_matrix(frame["embedding"])
    gold = frame["Industry"].to_list()

    def teacher(positions: np.ndarray) -> list[TeacherAnswer]:
        return [TeacherAnswer(gold[i]) for i in positions]

    started = time.perf_counter()
    result = run_cascade(vectors, teacher, spec, CHOICES, stored)
    seconds = time.perf_counter() - started
    labels = np.array(result.labels, dtype=object)
    by_teacher = np.array([by == "teacher" for by in result.labelled_by])
    chosen = result.target
    assert chosen is not None
    audit = [i for i, role in enumerate(result.roles) if role == "audit"]
    summary = CascadeSummary(
        rows=len(labels),
        teacher_rows=int(by_teacher.sum()),
        student_rows=sum(by == "student" for by in result.labelled_by),
        deferred_rows=sum(role == "deferred" for role in result.roles),
        audited_rows=len(audit),
        audit_agreed=sum(result.student_labels[i] == result.labels[i] for i in audit),
    )
    estimate = summary.all_rows_agreement()
    taught = np.flatnonzero(by_teacher)
    before = (
        (np.zeros((0, vectors.shape[1]), dtype=vectors.dtype), [])
        if stored is None
        else (stored.vectors, stored.labels)
    )
    grown = StoredStudent(np.vstack([before[0], vectors[taught]]), [*before[1], *(labels[taught].tolist())], spec.seed)
    row = {
        "file": path.stem,
        "accuracy": float((labels == np.array(gold, dtype=object)).mean()),
        "teacher_share": float(by_teacher.mean()),
        "threshold": "refused"
        if not chosen.met
        else ("none" if chosen.threshold is None else f"{chosen.threshold:.4f}"),
        "bound": chosen.metadata()["target_lower_bound"],
        "started_from": 0 if stored is None else len(stored.labels),
        "audit": "none" if estimate is None else "{:.4f} [{:.4f}, {:.4f}] on {} rows".format(*estimate, len(audit)),
        "seconds": seconds,
    }
    return row, grown


def report(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"{'file':>14} {'from model':>10} {'accuracy':>9} {'teacher':>8} {'threshold':>9} {'bound':>7} {'seconds':>8}  "
        "audit: agreement of all rows [95 %]"
    )
    for row in rows:
        print(
            f"{row['file']:>14} {row['started_from']:>10} {row['accuracy']:>9.4f} {row['teacher_share']:>8.4f} "
            f"{row['threshold']:>9} {row['bound']:>7.4f} {row['seconds']:>8.2f}  {row['audit']}"
        )
    reached = sum(row["accuracy"] >= TARGET.agreement for row in rows)
    median_share = statistics.median(row["teacher_share"] for row in rows)
    print(
        f"files reaching accuracy >= {TARGET.agreement}: {reached} of {len(rows)} (target >= 5: "
        f"{'met' if reached >= 5 else 'NOT met'}); median teacher share {median_share:.4f} (target <= 0.20: "
        f"{'met' if median_share <= 0.20 else 'NOT met'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=Path, help="a folder to keep the embedded files in (reused when there)")
    for name, default in SETTINGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--alone", action="store_true", help="also run each file alone, with no label model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_cascade_target_") as tmp:
        folder = args.vectors or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        paths = embedded_files(folder)
        target = TARGET.model_copy(update={"calibration_rows": args.calibration_rows})
        settings = {name: getattr(args, name) for name in SETTINGS if name != "calibration_rows"}
        spec = CascadeSpec(teacher=ColumnTeacher(column="Industry"), target=target, **settings)
        print(
            f"{len(paths)} files of {ROWS} rows, {NO_CUE_SHARE:.0%} without a cue; teacher = the gold column; "
            f"target {{agreement: {target.agreement}, confidence: {target.confidence}, calibration_rows: "
            f"{target.calibration_rows}}}; {', '.join(f'{k} {v}' for k, v in settings.items())}"
        )
        if args.alone:
            report("each file alone (its own sample trains its student):", [file_row(p, spec, None)[0] for p in paths])
        rows, stored = [], None
        for path in paths:
            row, stored = file_row(path, spec, stored)
            rows.append(row)
        report("files in order, each starting from the label model of the files before (as <task>/label_model):", rows)


if __name__ == "__main__":
    main()
