"""The drop-file parser: one row per record for any input, errors that name the file and line."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import re

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_assets.pipeline.inputs.read_prompts import DropFileError, ParseOptions, read_prompts

TEXT = ParseOptions(text_fields=("text",))
COMPANY = ParseOptions(text_fields=("Company",), txt_field="Company")


def errors_by_line(frame: pl.DataFrame) -> dict[int, str | None]:
    return dict(zip(frame["source_line"].to_list(), frame["error"].to_list(), strict=True))


def assert_row_ids(frame: pl.DataFrame) -> None:
    assert frame["row_id"].to_list() == list(range(frame.height))
    assert frame.columns[:2] == ["row_id", "source_line"] and frame.columns[-1] == "error"


# --- JSONL -----------------------------------------------------------------------------------


def test_jsonl_bad_lines_become_error_rows_naming_file_and_line() -> None:
    data = b"\n".join(
        [
            b'{"id": 1, "text": "fine"}',
            b'{"id": 2, "text": "broken json',
            b'{"id": 3, "text": 42}',
            b'{"id": 4, "text": ["a", "list"]}',
            b'{"id": 5, "text": {"an": "object"}}',
            b'{"id": 6, "text": true}',
            b'{"id": 7, "text": null}',
            b'{"id": 8, "body": "no text"}',
            b"",
            b"[1, 2]",
            b'{"id": 11, "text": "caf\xe9 latin-1"}',
            b'{"id": 12, "text": "half a pair \\ud83d"}',
            b'{"id": 13, "text": "last one"}',
        ]
    )
    frame = read_prompts(data, "posts/day1.jsonl", TEXT)
    assert_row_ids(frame)
    assert frame.height == 13
    errors = errors_by_line(frame)
    expected = {
        2: "malformed_json",
        3: "non_string_text",
        4: "non_string_text",
        5: "non_string_text",
        6: "non_string_text",
        7: "null_text",
        8: "missing_field",
        9: "empty_record",
        10: "not_an_object",
        11: "invalid_utf8",
        12: "invalid_unicode",
    }
    for line, code in expected.items():
        assert errors[line].startswith(f"{code}: posts/day1.jsonl line {line}:"), errors[line]
    assert errors[1] is None and errors[13] is None
    # What could be read is kept: the other fields, non-string values as JSON, bad bytes as U+FFFD.
    rows = {r["source_line"]: r for r in frame.to_dicts()}
    assert rows[3]["text"] == "42" and rows[5]["text"] == '{"an": "object"}' and rows[6]["text"] == "true"
    assert rows[8]["body"] == "no text" and rows[8]["id"] == "8"
    assert rows[11]["text"] == "caf\ufffd latin-1" and rows[11]["id"] == "11"
    assert rows[12]["text"] == "half a pair \ufffd"
    assert "a number" in errors[3] and "a list" in errors[4]


def test_jsonl_wrong_field_name_fails_the_file_listing_the_fields_found() -> None:
    data = b'{"Text": "a", "id": 1}\n{"Text": "b", "lang": "en"}\n'
    with pytest.raises(
        DropFileError,
        match=r"posts\.jsonl: no record has the field\(s\) \['text'\]; fields found: \['Text', 'id', 'lang'\]",
    ):
        read_prompts(data, "posts.jsonl", TEXT)


def test_jsonl_of_nothing_but_garbage_is_error_rows_not_a_failed_file() -> None:
    frame = read_prompts(b"not json\nalso not json\n", "junk.jsonl", TEXT)
    assert frame.height == 2 and frame["error"].str.starts_with("malformed_json").all()


def test_jsonl_byte_order_mark_and_crlf_are_accepted() -> None:
    frame = read_prompts(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r\n', "bom.jsonl", TEXT)
    assert frame["text"].to_list() == ["a", "b"] and frame["error"].null_count() == 2


def test_jsonl_columns_named_like_pipeline_columns_are_kept_under_input_prefix() -> None:
    data = b'{"text": "t", "row_id": 7, "error": "theirs", "label": "x", "input.label": "y", "request_key": "k"}\n'
    frame = read_prompts(data, "r.jsonl", TEXT)
    row = frame.to_dicts()[0]
    assert row["row_id"] == 0 and row["error"] is None
    assert row["input.row_id"] == "7" and row["input.error"] == "theirs" and row["input.request_key"] == "k"
    assert row["input.label"] == "y" and row["input.label_2"] == "x"
    # The columns the engine and validation add are taken too.
    data = b'{"text": "t", "confidence": "high", "cumulative_logprob": "n/a"}\n'
    row = read_prompts(data, "r.jsonl", TEXT).to_dicts()[0]
    assert row["input.confidence"] == "high" and row["input.cumulative_logprob"] == "n/a"
    # And those of embedding and similarity tasks.
    data = b'{"text": "t", "embedding": "[0.1]", "similarity": "0.9", "truncated": "no"}\n'
    row = read_prompts(data, "r.jsonl", TEXT).to_dicts()[0]
    assert (row["input.embedding"], row["input.similarity"], row["input.truncated"]) == ("[0.1]", "0.9", "no")


def test_jsonl_very_deep_nesting_is_an_error_row() -> None:
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    frame = read_prompts(deep + b'\n{"text": "ok"}\n', "deep.jsonl", TEXT)
    assert frame.height == 2 and frame["error"][0].startswith("malformed_json") and frame["error"][1] is None


# --- CSV -------------------------------------------------------------------------------------


def test_csv_quoted_commas_quotes_and_newlines_stay_in_their_field() -> None:
    data = (
        b"Index,Company,City\n"
        b'1,"Hartley & Boone, LLP","Columbus"\n'
        b'2,"The ""Quoted"" Co","Cork\nIreland"\n'
        b'3,"Multi\r\nline\r\nname",Paris\n'
        b"4,Plain,Berlin\n"
    )
    frame = read_prompts(data, "customers.csv", COMPANY)
    assert_row_ids(frame)
    assert frame["Company"].to_list() == ["Hartley & Boone, LLP", 'The "Quoted" Co', "Multi\r\nline\r\nname", "Plain"]
    assert frame["City"].to_list() == ["Columbus", "Cork\nIreland", "Paris", "Berlin"]
    # source_line is where each record starts, counting the newlines inside quoted fields.
    assert frame["source_line"].to_list() == [2, 3, 5, 8]
    assert frame["error"].null_count() == 4


def test_csv_ragged_blank_and_non_utf8_records_are_error_rows() -> None:
    data = b"Company,City\nAcme,Paris\nToo,many,fields\nTooFew\n\nCaf\xe9 Ltd,Lyon\nLast,Rome\n"
    frame = read_prompts(data, "c.csv", COMPANY)
    errors = errors_by_line(frame)
    assert frame.height == 6
    assert errors[2] is None and errors[7] is None
    assert errors[3].startswith("malformed_csv: c.csv line 3: 3 fields, the header has 2")
    assert errors[4].startswith("malformed_csv: c.csv line 4: 1 fields")
    assert errors[5].startswith("empty_record: c.csv line 5")
    assert errors[6].startswith("invalid_utf8: c.csv line 6")
    rows = {r["source_line"]: r for r in frame.to_dicts()}
    assert rows[3]["Company"] == "Too" and rows[4]["City"] is None and rows[6]["Company"] == "Caf\ufffd Ltd"


def test_csv_unterminated_quote_does_not_lose_the_records_before_it() -> None:
    frame = read_prompts(b'Company\nAcme\n"Open quote\nNever closed\n', "q.csv", COMPANY)
    assert frame["row_id"].to_list() == [0, 1] and frame["Company"][0] == "Acme" and frame["error"][0] is None
    assert frame["source_line"][1] == 3


def test_csv_wrong_column_fails_the_file_listing_the_columns_found() -> None:
    with pytest.raises(
        DropFileError, match=r"c\.csv: column\(s\) \['Company'\] not found; columns found: \['Name', 'City'\]"
    ):
        read_prompts(b"Name,City\nAcme,Paris\n", "c.csv", COMPANY)


def test_csv_repeated_or_empty_header_names_keep_every_column() -> None:
    frame = read_prompts(b"Company,Company,,City\nA,B,C,D\n", "h.csv", COMPANY)
    assert frame.columns == ["row_id", "source_line", "Company", "Company_duplicated_0", "column_3", "City", "error"]
    assert frame.row(0)[2:6] == ("A", "B", "C", "D")


def test_csv_byte_order_mark_is_not_part_of_the_first_column_name() -> None:
    frame = read_prompts(b"\xef\xbb\xbfCompany,City\r\nAcme,Paris\r\n", "bom.csv", COMPANY)
    assert frame["Company"].to_list() == ["Acme"]


# --- empty files, header-only files, other formats --------------------------------------------


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("e.jsonl", b""),
        ("e.csv", b""),
        ("e.txt", b""),
        ("w.jsonl", b"\n \n\t\n"),
        ("w.txt", b"\r\n"),
        ("bom.csv", b"\xef\xbb\xbf"),
    ],
)
def test_an_empty_file_gives_zero_rows_with_the_text_column(name: str, data: bytes) -> None:
    options = COMPANY if name.endswith(".csv") else TEXT
    frame = read_prompts(data, name, options)
    assert frame.height == 0
    assert frame.columns == ["row_id", "source_line", options.text_fields[0], "error"]


def test_a_header_only_csv_gives_zero_rows_with_its_columns() -> None:
    frame = read_prompts(b"Index,Company,City\n", "h.csv", COMPANY)
    assert frame.height == 0 and frame.columns == ["row_id", "source_line", "Index", "Company", "City", "error"]


def test_txt_one_prompt_a_line_with_bad_bytes_flagged() -> None:
    frame = read_prompts(b"first\r\nsecond \xff\n\nfourth", "q.txt", TEXT)
    assert frame["text"].to_list() == ["first", "second \ufffd", "", "fourth"]
    assert frame["error"][1].startswith("invalid_utf8: q.txt line 2: byte 8 of the line is not UTF-8")
    assert frame["error"].null_count() == 3  # the blank line becomes `empty_text` when prompts are formatted


def test_parquet_non_string_and_null_text_are_error_rows() -> None:
    buffer = io.BytesIO()
    pl.DataFrame({"text": [1, None, 3], "n": [1.5, 2.5, 3.5], "row_id": [9, 9, 9]}).write_parquet(buffer)
    frame = read_prompts(buffer.getvalue(), "p.parquet", TEXT)
    assert_row_ids(frame)
    assert frame["text"].to_list() == ["1", None, "3"] and frame["n"].to_list() == [1.5, 2.5, 3.5]
    assert frame["input.row_id"].to_list() == [9, 9, 9]
    assert frame["error"][0].startswith("non_string_text: p.parquet row 1: field 'text' is Int64")
    assert frame["error"][1].startswith("null_text: p.parquet row 2")


def test_parquet_nested_text_is_kept_as_json() -> None:
    buffer = io.BytesIO()
    pl.DataFrame({"text": [["a", "b"], None]}).write_parquet(buffer)
    frame = read_prompts(buffer.getvalue(), "p.parquet", TEXT)
    assert frame["text"][0] is not None and frame["error"][0].startswith("non_string_text")


def test_unreadable_parquet_and_unknown_suffix_fail_the_file() -> None:
    with pytest.raises(DropFileError, match="x.parquet: not a readable parquet file"):
        read_prompts(b"PAR1 but not really", "x.parquet", TEXT)
    with pytest.raises(DropFileError, match=r"x.xlsx: unsupported file type; inputs are .jsonl, .csv, .parquet, .txt"):
        read_prompts(b"", "x.xlsx", TEXT)


@pytest.mark.parametrize(
    ("name", "data", "options"),
    [
        ("posts.jsonl.gz", b'{"text": "a"}\nnot json\n{"text": "c"}\n', TEXT),
        ("Customers.CSV.GZ", b'Company,City\nAcme,Paris\n"Law, LLP",Rome\n', COMPANY),
        ("prompts.txt.gz", "one\ntwo \u00e9\n".encode(), TEXT),
    ],
)
def test_gzip_compressed_inputs_read_like_the_plain_file(name: str, data: bytes, options: ParseOptions) -> None:
    plain = read_prompts(data, name.removesuffix(".gz").removesuffix(".GZ"), options)
    compressed = read_prompts(gzip.compress(data), name, options)
    assert compressed.drop("error").equals(plain.drop("error"))
    assert compressed["error"].is_null().to_list() == plain["error"].is_null().to_list()
    assert compressed.height == data.count(b"\n") - (name.lower().startswith("customers"))


def test_truncated_or_corrupt_gzip_fails_the_file_naming_it() -> None:
    whole = gzip.compress(b'{"text": "a"}\n' * 1000)
    with pytest.raises(DropFileError, match=r"posts.jsonl.gz: the gzip file is incomplete .*drop the whole file again"):
        read_prompts(whole[: len(whole) // 2], "posts.jsonl.gz", TEXT)
    with pytest.raises(DropFileError, match=r"posts.jsonl.gz: not a readable gzip file"):
        read_prompts(b'{"text": "not compressed"}\n', "posts.jsonl.gz", TEXT)


# --- size: duplicates, very long texts, many rows ---------------------------------------------


def test_duplicate_records_each_keep_their_own_row() -> None:
    data = b'{"text": "same"}\n' * 5
    frame = read_prompts(data, "d.jsonl", TEXT)
    assert frame.height == 5 and frame["source_line"].to_list() == [1, 2, 3, 4, 5]


def test_very_long_texts_are_read_whole() -> None:
    long_text = "word " * 400_000  # 2 MB, above the csv module's default field limit
    csv_bytes = ("Company\n" + '"' + long_text + '"\nShort\n').encode()
    frame = read_prompts(csv_bytes, "long.csv", COMPANY)
    assert frame["Company"].to_list() == [long_text, "Short"] and frame["error"].null_count() == 2
    jsonl = (json.dumps({"text": long_text}) + "\n").encode()
    assert read_prompts(jsonl, "long.jsonl", TEXT)["text"][0] == long_text


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_a_file_of_150_000_rows_keeps_every_row_in_order(suffix: str) -> None:
    n = 150_000
    if suffix == ".jsonl":
        data = "".join(f'{{"text": "post {i}", "i": {i}}}\n' for i in range(n)).encode()
    elif suffix == ".csv":
        data = ("i,Company\n" + "".join(f'{i},"Company {i}, Inc."\n' for i in range(n))).encode()
    else:
        data = "".join(f"prompt {i}\n" for i in range(n)).encode()
    options = COMPANY if suffix == ".csv" else TEXT
    frame = read_prompts(data, "big" + suffix, options)
    assert frame.height == n
    assert_row_ids(frame)
    field = options.text_fields[0]
    assert frame[field][n - 1].endswith(f"{n - 1}, Inc." if suffix == ".csv" else f"{n - 1}")
    assert frame["source_line"][n - 1] == (n + 1 if suffix == ".csv" else n)
    assert frame["error"].null_count() == n


# --- properties over generated inputs ---------------------------------------------------------


def expected_line_count(data: bytes) -> int:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if not data.strip():
        return 0
    lines = data.split(b"\n")
    return len(lines) - (1 if lines[-1] == b"" else 0)


def check_shape(frame: pl.DataFrame) -> None:
    assert_row_ids(frame)
    lines = frame["source_line"].to_list()
    assert lines == sorted(lines) and len(set(lines)) == len(lines)


LINE_BYTES = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.sampled_from(
            [b'{"text": "ok"}', b'{"text": 1}', b"{}", b"[]", b'{"text": "\\ud800"}', b"\xff\xfe", b"\r", b" "]
        ),
    ),
    max_size=12,
).map(b"\n".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=LINE_BYTES, suffix=st.sampled_from([".jsonl", ".txt"]))
def test_any_bytes_give_one_row_per_line_or_a_file_error(data: bytes, suffix: str) -> None:
    try:
        frame = read_prompts(data, "any" + suffix, TEXT)
    except DropFileError as exc:
        assert suffix == ".jsonl" and "no record has the field(s) ['text']" in str(exc)
        return
    check_shape(frame)
    assert frame.height == expected_line_count(data)
    if frame.height:
        assert frame["source_line"].to_list() == list(range(1, frame.height + 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=120))
def test_any_csv_body_after_a_valid_header_never_raises(body: bytes) -> None:
    frame = read_prompts(b"text,other\n" + body, "any.csv", TEXT)
    check_shape(frame)
    assert frame.columns == ["row_id", "source_line", "text", "other", "error"]
    assert frame["source_line"].min() is None or frame["source_line"].min() >= 2
    # A row without an error holds exactly the two fields of a well-formed record.
    clean = frame.filter(pl.col("error").is_null())
    assert clean["text"].null_count() == 0 and clean["other"].null_count() == 0


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_any_bytes_as_parquet_is_a_file_error_or_rows(data: bytes) -> None:
    with contextlib.suppress(DropFileError):
        check_shape(read_prompts(data, "any.parquet", TEXT))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)
RECORDS = st.lists(
    st.fixed_dictionaries(
        {"text": st.text()}, optional={"id": st.integers(), "meta": JSON_VALUES, "lang": st.text(max_size=3)}
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(records=RECORDS, ascii_only=st.booleans(), crlf=st.booleans())
def test_jsonl_records_round_trip_one_row_each(records: list[dict], ascii_only: bool, crlf: bool) -> None:
    newline = "\r\n" if crlf else "\n"
    data = "".join(json.dumps(r, ensure_ascii=ascii_only) + newline for r in records).encode("utf-8")
    frame = read_prompts(data, "gen.jsonl", TEXT)
    check_shape(frame)
    assert frame.height == len(records)
    assert frame["text"].to_list() == [r["text"] for r in records]
    assert frame["error"].null_count() == len(records)
    if "id" in frame.columns:
        assert frame["id"].to_list() == [None if "id" not in r else str(r["id"]) for r in records]


CSV_CELLS = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=15)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(CSV_CELLS, CSV_CELLS), min_size=1, max_size=20), terminator=st.sampled_from(["\n", "\r\n"])
)
def test_csv_records_round_trip_with_the_line_each_starts_on(rows: list[tuple[str, str]], terminator: str) -> None:
    buffer = io.StringIO(newline="")
    # With "\n" line ends a bare "\r" is only safe inside quotes (the csv module ends lines at "\r" too).
    writer = csv.writer(
        buffer, lineterminator=terminator, quoting=csv.QUOTE_MINIMAL if terminator == "\r\n" else csv.QUOTE_ALL
    )
    writer.writerow(["Company", "note"])
    starts = []
    for row in rows:
        starts.append(len(re.findall(r"\r\n|\r|\n", buffer.getvalue())) + 1)
        writer.writerow(row)
    frame = read_prompts(buffer.getvalue().encode("utf-8"), "gen.csv", COMPANY)
    check_shape(frame)
    assert frame.height == len(rows)
    assert list(zip(frame["Company"].to_list(), frame["note"].to_list(), strict=True)) == rows
    assert frame["source_line"].to_list() == starts
    assert frame["error"].null_count() == len(rows)
