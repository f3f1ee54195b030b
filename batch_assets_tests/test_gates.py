"""The pure computations behind the gates: code versions, cost estimate and budget, accuracy, drift;
and the task settings that configure them (bad values refused at load, naming file and key)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from batch_assets.lib.asset_metadata import labels_metadata
from batch_assets.pipeline.budget import actual_cost_metadata, budget_overruns, estimate_cost
from batch_assets.pipeline.label_quality import NO_LABEL, accuracy_report, confidence_report, label_drift
from batch_assets.pipeline.task_formats import task_format
from batch_assets.pipeline.task_spec import BudgetSpec, TaskSpec, TaskSpecError, load_task_spec
from batch_assets_tests.support import POSTS_CHOICES_TASK, task_code_versions

BASE = POSTS_CHOICES_TASK


def spec(**changes) -> TaskSpec:
    raw = json.loads(json.dumps(BASE))
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return TaskSpec.model_validate(raw)


# --- code versions -------------------------------------------------------------------------------


def test_same_task_same_versions_edits_change_the_assets_they_affect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    base = task_code_versions(spec())
    assert base == task_code_versions(spec())
    assert set(base) == {"formatted_prompts", "inference_outputs", "validated_labels"}

    prompt_edit = task_code_versions(spec(prompt__template="Text: {text}"))
    assert prompt_edit["formatted_prompts"] != base["formatted_prompts"]
    assert prompt_edit["inference_outputs"] != base["inference_outputs"]
    assert prompt_edit["validated_labels"] != base["validated_labels"]
    # Checks read the labels, they do not change them.
    assert task_code_versions(spec(checks__max_label_drift=0.5, checks__max_error_share=0.2)) == base

    sampling_edit = task_code_versions(spec(sampling__temperature=0.7))
    assert sampling_edit["formatted_prompts"] == base["formatted_prompts"]
    assert sampling_edit["inference_outputs"] != base["inference_outputs"]

    output_edit = task_code_versions(spec(output__choices=["positive", "negative"]))
    assert output_edit["inference_outputs"] != base["inference_outputs"]
    assert output_edit["validated_labels"] != base["validated_labels"]

    model_edit = task_code_versions(spec(engine__model="HuggingFaceTB/SmolLM2-1.7B-Instruct"))
    assert model_edit["formatted_prompts"] != base["formatted_prompts"]  # another tokenizer and chat template
    assert model_edit["inference_outputs"] != base["inference_outputs"]
    monkeypatch.setenv("BATCH_ASSETS_MODEL", "/models/other")
    assert task_code_versions(spec())["inference_outputs"] != base["inference_outputs"]


def test_throughput_settings_leave_the_versions_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    base = task_code_versions(spec())
    tuned = task_code_versions(
        spec(engine__batch_size=64, engine__max_num_seqs=8, engine__kv_cache_memory_gib=2, engine__concurrency=4)
    )
    assert tuned == base
    assert task_code_versions(spec(engine__seed=7))["inference_outputs"] != base["inference_outputs"]


def test_versions_are_stable_across_processes(tmp_path: Path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text(json.dumps(BASE))  # JSON is YAML
    script = (
        "import json, sys; from pathlib import Path; "
        "from batch_assets.pipeline.code_versions import code_versions; "
        "from batch_assets.engines.kinds import resolve_settings; "
        "from batch_assets.pipeline.task_spec import load_task_spec; "
        "task = load_task_spec(Path(sys.argv[1])); "
        "print(json.dumps(code_versions(task, resolve_settings(task))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "BATCH_ASSETS_MODEL"}
    env["PYTHONHASHSEED"] = "random"
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script, str(task)], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]["inference_outputs"]) == 16


# --- budget --------------------------------------------------------------------------------------


def formatted(tokens: list[int | None], errors: list[str | None]) -> pl.DataFrame:
    return pl.DataFrame(
        {"row_id": range(len(tokens)), "num_prompt_tokens": tokens, "error": errors},
        schema_overrides={"error": pl.String},
    )


def test_estimate_counts_rows_sent_to_the_engine_at_worst_case() -> None:
    task = spec(engine__price={"input_per_million_tokens": 2.0, "output_per_million_tokens": 10.0})
    # The third row is too long: it never reaches the engine, so it costs nothing.
    estimate = estimate_cost(formatted([100, 300, 5000], [None, None, "too_long: 5000 tokens"]), task_format(task))
    assert (estimate.rows_to_infer, estimate.prompt_tokens, estimate.max_generated_tokens) == (2, 400, 20)
    assert estimate.cost_usd == pytest.approx(400 * 2 / 1e6 + 20 * 10 / 1e6)
    assert estimate.metadata() == {
        "estimated_prompt_tokens": 400,
        "estimated_max_generated_tokens": 20,
        "estimated_max_cost_usd": 0.001,
    }
    assert "estimated_max_cost_usd" not in estimate_cost(formatted([1], [None]), task_format(spec())).metadata()


def test_overruns_name_estimate_and_limit() -> None:
    task = spec(engine__price={"input_per_million_tokens": 1000.0, "output_per_million_tokens": 0.0})
    estimate = estimate_cost(formatted([600, 600], [None, None]), task_format(task))  # 1,200 prompt tokens, $1.20
    assert budget_overruns(estimate, None) == []
    assert (
        budget_overruns(estimate, BudgetSpec(max_prompt_tokens=1200, max_generated_tokens=20, max_cost_usd=1.2)) == []
    )
    overruns = budget_overruns(estimate, BudgetSpec(max_prompt_tokens=1000, max_generated_tokens=19, max_cost_usd=1.0))
    assert overruns == [
        "prompt tokens 1,200 exceed budget.max_prompt_tokens 1,000",
        "worst-case generated tokens 20 (2 rows x sampling.max_tokens) exceed budget.max_generated_tokens 19",
        "worst-case cost $1.2000 exceeds budget.max_cost_usd $1.0000",
    ]


def test_actual_cost_needs_a_price() -> None:
    price = spec(engine__price={"input_per_million_tokens": 0.5, "output_per_million_tokens": 1.5}).engine.price
    assert actual_cost_metadata(2_000_000, 1_000_000, price) == {"cost_usd": 2.5}
    assert actual_cost_metadata(2_000_000, 1_000_000, None) == {}


# --- accuracy ------------------------------------------------------------------------------------


def test_accuracy_precision_recall_and_confusion() -> None:
    labels = pl.DataFrame(
        {
            "row_id": range(6),
            "text": list("abcdef"),
            "truth": ["positive", "positive", "negative", " negative ", "neutral", ""],
            "label": ["positive", "negative", "negative", None, "positive", "positive"],
        }
    )
    report = accuracy_report(labels, "truth")
    # The last row has no gold value; the error row (label None) counts as wrong.
    assert (report.rows_with_gold, report.correct) == (5, 2)
    assert report.accuracy == pytest.approx(0.4)
    assert report.per_label_metadata() == {
        "negative": {"precision": 0.5, "recall": 0.5, "support": 2},
        "neutral": {"precision": None, "recall": 0.0, "support": 1},
        "positive": {"precision": 0.5, "recall": 0.5, "support": 2},
    }
    assert report.confusion == {
        "positive": {"positive": 1, "negative": 1},
        "negative": {"negative": 1, NO_LABEL: 1},
        "neutral": {"positive": 1},
    }
    assert report.confusion_markdown().splitlines() == [
        "| gold \\ predicted | negative | positive | (error) |",
        "|---|---|---|---|",
        "| negative | 1 | 0 | 1 |",
        "| neutral | 0 | 1 | 0 |",
        "| positive | 1 | 1 | 0 |",
    ]


def test_every_choice_is_a_confusion_column_and_a_per_label_row() -> None:
    labels = pl.DataFrame({"truth": ["positive", "negative", "negative"], "label": ["positive", "positive", None]})
    report = accuracy_report(labels, "truth", choices=["positive", "negative", "neutral"])
    # "negative" and "neutral" are never predicted: still columns, in the task's order, `(error)` last.
    assert report.confusion_markdown().splitlines() == [
        "| gold \\ predicted | positive | negative | neutral | (error) |",
        "|---|---|---|---|---|",
        "| positive | 1 | 0 | 0 | 0 |",
        "| negative | 1 | 0 | 0 | 1 |",
    ]
    assert report.per_label_records() == [
        {"label": "positive", "precision": 0.5, "recall": 1.0, "support": 1},
        {"label": "negative", "precision": None, "recall": 0.0, "support": 2},
        {"label": "neutral", "precision": None, "recall": None, "support": 0},
    ]


def test_validated_labels_metadata_a_person_reads() -> None:
    task = spec(checks__gold_field="truth")
    labels = pl.DataFrame(
        {
            "row_id": [0, 1, 2, 3],
            "source_line": [2, 3, 5, 6],
            "text": ["great", "awful", "", "meh"],
            "truth": ["positive", "negative", "neutral", "neutral"],
            "confidence": [0.8731892456817627, 0.5, None, 0.3333333333],
            "label": ["positive", "positive", None, "neutral"],
            "error": [None, None, "empty_text: the field 'text' is empty", None],
        }
    )
    metadata = labels_metadata(labels, task, task_format(task))
    # The preview: the gold column right after the label, confidence to 3 digits.
    assert metadata["preview"].value.splitlines() == [
        "| text | label | truth | confidence | error |",
        "|---|---|---|---|---|",
        "| great | positive | positive | 0.873 |  |",
        "| awful | positive | negative | 0.5 |  |",
        "|  |  | neutral |  | empty_text: the field 'text' is empty |",
        "| meh | neutral | neutral | 0.333 |  |",
    ]
    # One error row in four is under the task's max_error_share, and still listed with its file line.
    assert metadata["error_rows_preview"].value.splitlines() == [
        "| row_id | source_line | error |",
        "|---|---|---|",
        "| 2 | 5 | empty_text: the field 'text' is empty |",
    ]
    # per_label is a table, one row per choice; "negative" was never predicted.
    per_label = metadata["per_label"]
    assert isinstance(per_label, dg.TableMetadataValue)
    assert [column.name for column in per_label.schema.columns] == ["label", "precision", "recall", "support"]
    assert [record.data for record in per_label.records] == [
        {"label": "positive", "precision": 0.5, "recall": 1.0, "support": 1},
        {"label": "negative", "precision": None, "recall": 0.0, "support": 1},
        {"label": "neutral", "precision": 1.0, "recall": 0.5, "support": 2},
    ]
    assert metadata["confusion"].value.splitlines()[0] == (
        "| gold \\ predicted | positive | negative | neutral | (error) |"
    )


def test_error_rows_listed_are_the_first_five() -> None:
    labels = pl.DataFrame(
        {
            "row_id": range(8),
            "source_line": range(2, 10),
            "text": ["x"] * 8,
            "label": [None] * 7 + ["positive"],
            "error": [f"too_long: prompt {i}" for i in range(7)] + [None],
        }
    )
    task = spec()
    metadata = labels_metadata(labels, task, task_format(task))
    rows = metadata["error_rows_preview"].value.splitlines()[2:]
    assert rows == [f"| {i} | {i + 2} | too_long: prompt {i} |" for i in range(5)]
    assert "error_rows_preview" not in labels_metadata(labels.tail(1), task, task_format(task))


def test_accuracy_on_a_json_field_and_without_gold() -> None:
    labels = pl.DataFrame(
        {"gold": ["cat", "dog", "3"], "label": ['{"animal": "cat"}', '{"animal": "cat"}', '{"animal": 3}']}
    )
    report = accuracy_report(labels, "gold", "animal")
    assert (report.rows_with_gold, report.correct) == (3, 2)
    assert accuracy_report(labels, "missing_column") is None
    assert accuracy_report(labels.with_columns(pl.lit(None, pl.String).alias("gold")), "gold") is None


# --- drift ---------------------------------------------------------------------------------------


def test_confidence_report_counts_labels_under_the_minimum_among_those_measured() -> None:
    labels = pl.DataFrame(
        {
            "label": ["a", "b", "a", None, "b"],
            "confidence": [0.95, 0.3, None, None, 0.45],
        }
    )
    report = confidence_report(labels, min_confidence=0.5)
    assert report is not None
    assert (report.labelled_rows, report.measured_rows, report.unmeasured_rows, report.low_rows) == (4, 3, 1, 2)
    assert report.low_share == pytest.approx(2 / 3) and report.median == pytest.approx(0.45)
    assert report.metadata() == {"confidence_median": 0.45, "low_confidence_rows": 2, "low_confidence_share": 0.6667}
    assert confidence_report(labels.drop("confidence"), 0.5) is None  # a text or JSON task
    nothing = confidence_report(labels.with_columns(pl.lit(None, dtype=pl.Float64).alias("confidence")), 0.5)
    assert nothing is not None and (nothing.measured_rows, nothing.low_share, nothing.median) == (0, 0.0, None)
    assert nothing.metadata() == {}  # nothing measured: no figures that would read as "0 % low"


def test_drift_is_total_variation_distance_and_names_moved_labels() -> None:
    history = [{"positive": 30, "negative": 10}, {"positive": 30, "negative": 10, "neutral": 20}]
    # Pooled history: positive 60 %, negative 20 %, neutral 20 %.
    report = label_drift({"positive": 10, "negative": 40, "neutral": 10}, history)
    assert report.partitions_compared == 2
    assert report.distance == pytest.approx(0.4667, abs=1e-4)  # negative +46.7 pts, positive -43.3, neutral -3.3
    assert report.moved == ["negative", "positive"]
    assert report.moved_text() == "negative 20% -> 67%, positive 60% -> 17%"
    same = label_drift({"positive": 6, "negative": 2, "neutral": 2}, history)
    assert same.distance == 0 and same.moved == []
    assert label_drift({"positive": 1}, [{"negative": 5}]).distance == 1.0


def test_no_history_means_no_drift_report() -> None:
    assert label_drift({"positive": 3}, []) is None
    assert label_drift({"positive": 3}, [{}]) is None
    assert label_drift({}, [{"positive": 3}]) is None


# --- task settings -------------------------------------------------------------------------------


def write_task(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "t.yaml"
    # An `output` in `extra` replaces the default one (a key given twice is refused).
    output = "" if extra.startswith("output:") or "\noutput:" in extra else "output: {kind: choices, choices: [a, b]}\n"
    path.write_text("input: {text_fields: [text]}\nprompt: {template: '{text}'}\n" + output + extra)
    return path


@pytest.mark.parametrize(
    ("extra", "key", "problem"),
    [
        ("budget: {max_prompt_tokens: -5}\n", "budget.max_prompt_tokens", "greater than or equal to 0"),
        ("budget: {max_generated_tokens: lots}\n", "budget.max_generated_tokens", "valid integer"),
        ("budget: {max_prompt_tokens: true}\n", "budget.max_prompt_tokens", "valid integer"),
        (
            "budget: {max_cost_usd: '5'}\nengine: {price: {input_per_million_tokens: 1}}\n",
            "budget.max_cost_usd",
            "valid number",
        ),
        ("budget: {max_cost_usd: 5}\n", "budget.max_cost_usd needs engine.price", ""),
        (
            "engine: {price: {input_per_million_tokens: -1}}\n",
            "engine.price.input_per_million_tokens",
            "greater than or equal to 0",
        ),
        ("checks: {max_label_drift: 1.5}\n", "checks.max_label_drift", "less than or equal to 1"),
        ("checks: {max_label_drift: -0.1}\n", "checks.max_label_drift", "greater than or equal to 0"),
        ("checks: {min_accuracy: 2}\n", "checks.min_accuracy", "less than or equal to 1"),
        ("checks: {min_confidence: 1.2}\n", "checks.min_confidence", "less than or equal to 1"),
        (
            "checks: {min_confidence: 0.7}\noutput: {kind: text}\n",
            "checks.min_confidence applies to `output.kind: choices` or `regex` only",
            "",
        ),
        ("checks: {max_low_confidence_share: -1}\n", "checks.max_low_confidence_share", "greater than or equal to 0"),
        ("checks: {gold_json_field: x}\n", "checks.gold_json_field applies to `output.kind: json_schema` only", ""),
        ("automation: {rematerialize_stale: maybe}\n", "automation.rematerialize_stale", "valid boolean"),
    ],
)
def test_bad_gate_settings_are_refused_naming_file_and_key(tmp_path: Path, extra: str, key: str, problem: str) -> None:
    path = write_task(tmp_path, extra)
    with pytest.raises(TaskSpecError) as raised:
        load_task_spec(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ")
    assert key in message and problem in message


def test_price_without_budget_is_fine(tmp_path: Path) -> None:
    task = load_task_spec(
        write_task(tmp_path, "engine: {price: {input_per_million_tokens: 0.2, output_per_million_tokens: 0.8}}\n")
    )
    assert task.budget is None
    assert task.engine.price.output_per_million_tokens == 0.8


# --- code versions and automation in the definitions ---------------------------------------------


def test_definitions_carry_the_versions_and_opted_in_tasks_rematerialize_stale_partitions(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dagster as dg

    from batch_assets.lib.task_definitions import build_definitions
    from batch_assets.storage.drop_files import partitions_def_name

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    plain = spec()
    assert (
        not build_definitions(tasks=[plain])
        .resolve_asset_graph()
        .get(dg.AssetKey(["t", "inference_outputs"]))
        .automation_condition
    )
    opted = spec(automation__rematerialize_stale=True)
    edited = spec(automation__rematerialize_stale=True, prompt__template="Text: {text}")
    defs = build_definitions(tasks=[opted])
    graph = defs.resolve_asset_graph()
    for asset, version in task_code_versions(opted).items():
        assert graph.get(dg.AssetKey(["t", asset])).code_version == version
    assert graph.get(dg.AssetKey(["t", "raw_prompts"])).automation_condition is None
    sensor = defs.resolve_sensor_def("t_automation_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(partitions_def_name("t"), ["a.jsonl", "b.jsonl"])
        # a.jsonl was labelled with the first version of the task; b.jsonl never ran.
        for asset in ("raw_prompts", "formatted_prompts", "inference_outputs", "validated_labels"):
            instance.report_runless_asset_event(dg.AssetMaterialization(dg.AssetKey(["t", asset]), partition="a.jsonl"))
        first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert first.total_requested == 0
        unchanged = dg.evaluate_automation_conditions(
            defs=build_definitions(tasks=[opted]), instance=instance, cursor=first.cursor
        )
        assert unchanged.total_requested == 0  # a restart with the same task requests nothing
        after_edit = dg.evaluate_automation_conditions(
            defs=build_definitions(tasks=[edited]), instance=instance, cursor=unchanged.cursor
        )
        for asset in ("formatted_prompts", "inference_outputs", "validated_labels"):
            assert after_edit.get_requested_partitions(dg.AssetKey(["t", asset])) == {"a.jsonl"}
        assert after_edit.total_requested == 3
        handled = dg.evaluate_automation_conditions(
            defs=build_definitions(tasks=[edited]), instance=instance, cursor=after_edit.cursor
        )
        assert handled.total_requested == 0


def test_confidence_can_be_switched_off_without_re_inferring_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_assets.engines.vllm_engine import VLLMEngine
    from batch_assets.engines.vllm_session import VLLMSession
    from batch_assets.lib.assets import inference_fingerprint
    from batch_assets.pipeline.task_formats import task_format
    from batch_assets.pipeline.validate_labels import validate_labels

    monkeypatch.delenv("BATCH_ASSETS_MODEL", raising=False)
    on, off = spec(), spec(output__confidence=False)
    assert on.output.has_confidence and not off.output.has_confidence
    # The generated text does not depend on it: same checkpoints, cache and inference version; the
    # labels lose a column, so their version changes.
    settings = VLLMEngine().settings(on)
    assert inference_fingerprint(task_format(on), settings) == inference_fingerprint(task_format(off), settings)
    versions_on, versions_off = task_code_versions(on), task_code_versions(off)
    assert versions_on["inference_outputs"] == versions_off["inference_outputs"]
    assert versions_on["validated_labels"] != versions_off["validated_labels"]
    # Off, the engine is not asked for log-probabilities and the labels have no confidence column.
    asked = {
        name: VLLMSession(task, settings, print)._params(task.sampling, task.output).logprobs
        for name, task in (("on", on), ("off", off))
    }
    assert asked == {"on": 0, "off": None}
    outputs = pl.DataFrame(
        {
            "row_id": [0, 1],
            "source_line": [1, 2],
            "text": ["great", "bad"],
            "generated_text": ["positive", "negative"],
            "finish_reason": ["stop", "stop"],
            "num_prompt_tokens": [5, 5],
            "num_generated_tokens": [2, 2],
            "cumulative_logprob": [-0.1, -0.7],
            "error": [None, None],
        }
    )
    assert validate_labels(outputs, on.output)["confidence"].round(3).to_list() == [0.905, 0.497]
    labels_off = validate_labels(outputs, off.output)
    assert "confidence" not in labels_off.columns and labels_off["label"].to_list() == ["positive", "negative"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"output__kind": "text", "output__choices": None, "output__confidence": True}, "output.confidence applies"),
        ({"output__confidence": False, "checks__min_confidence": 0.7}, "with `output.confidence` on"),
    ],
)
def test_confidence_settings_that_cannot_apply_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**changes)
