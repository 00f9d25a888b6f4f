"""The converter: every input format, rejected rows, atomic writes, CLI exit codes."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime_hydra.data import convert as C
from slime_hydra.data.dataset import read_rows

RECS = [
    {"question": "What is 2+2?", "answer": 4, "level": "easy", "src": "x"},
    {"question": "", "answer": "1", "level": "easy", "src": "x"},          # empty prompt
    {"question": "Name a colour.", "answer": None, "level": "hard", "src": "y"},  # missing label
    {"question": "Half of 1?", "answer": 0.5, "level": "hard", "src": "y"},
]
OPTS = ["--input-col", "question", "--label-col", "answer", "--metadata-cols", "level"]


def read_out(path):
    return [json.loads(x) for x in open(path)]


def run(argv, capsys):
    rc = C.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def check_standard_output(out_path, summary_text, locs):
    rows = read_out(out_path)
    assert rows == [
        {"prompt": "What is 2+2?", "label": "4", "metadata": {"level": "easy"}},
        {"prompt": "Half of 1?", "label": "0.5", "metadata": {"level": "hard"}},
    ]
    assert f"wrote 2 rows to {out_path}; rejected 2" in summary_text
    assert f"{locs[0]}: empty prompt" in summary_text and f"{locs[1]}: missing label" in summary_text
    assert len(read_rows(out_path)) == 2  # what we write, training reads


def write_delimited(path, sep):
    lines = [sep.join(["question", "answer", "level", "src"])]
    for r in RECS:
        lines.append(sep.join("" if r[k] is None else str(r[k]) for k in ["question", "answer", "level", "src"]))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_delimited(tmp_path, capsys, fmt):
    src, dst = tmp_path / f"in.{fmt}", str(tmp_path / "out.jsonl")
    write_delimited(src, "," if fmt == "csv" else "\t")
    rc, out, _ = run([str(src), dst, *OPTS], capsys)
    assert rc == 0
    check_standard_output(dst, out, ["line 3", "line 4"])


def test_csv_quoted_multiline_field_keeps_line_numbers(tmp_path, capsys):
    src, dst = tmp_path / "in.csv", str(tmp_path / "o.jsonl")
    src.write_text('prompt,label\n"two\nlines",1\n,2\nok,3\n')
    rc, out, _ = run([str(src), dst], capsys)
    assert rc == 0 and "line 4: empty prompt" in out
    assert [r["prompt"] for r in read_out(dst)] == ["two\nlines", "ok"]


@pytest.mark.parametrize("kind", ["jsonl", "json_list", "json_lines"])
def test_json_inputs(tmp_path, capsys, kind):
    src, dst = tmp_path / ("in.jsonl" if kind == "jsonl" else "in.json"), str(tmp_path / "out.jsonl")
    if kind == "json_list":
        src.write_text(json.dumps(RECS, indent=1))
        locs = ["item 1", "item 2"]
    else:
        src.write_text("".join(json.dumps(r) + "\n" for r in RECS))
        locs = ["line 2", "line 3"]
    rc, out, _ = run([str(src), dst, *OPTS], capsys)
    assert rc == 0
    check_standard_output(dst, out, locs)


def test_parquet(tmp_path, capsys):
    src, dst = tmp_path / "in.parquet", str(tmp_path / "out.jsonl")
    pq.write_table(pa.table({k: [str(r[k]) if r[k] is not None and k == "answer" else r[k] for r in RECS]
                             for k in RECS[0]}), src)
    rc, out, _ = run([str(src), dst, *OPTS], capsys)
    assert rc == 0
    check_standard_output(dst, out, ["row 1", "row 2"])


def test_hf_dataset_dir_and_splits(tmp_path, capsys):
    import datasets
    cols = {k: [r[k] if k != "answer" else (None if r[k] is None else str(r[k])) for r in RECS] for k in RECS[0]}
    ds = datasets.Dataset.from_dict(cols)
    ds.save_to_disk(str(tmp_path / "one"))
    dst = str(tmp_path / "out.jsonl")
    rc, out, _ = run([str(tmp_path / "one"), dst, *OPTS], capsys)
    assert rc == 0
    check_standard_output(dst, out, ["row 1", "row 2"])

    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    rc, _, err = run([str(tmp_path / "dd"), str(tmp_path / "o2.jsonl"), *OPTS], capsys)
    assert rc == 1 and "pick one with --split (train, test)" in err
    rc, out, _ = run([str(tmp_path / "dd"), str(tmp_path / "o2.jsonl"), *OPTS, "--split", "test"], capsys)
    assert rc == 0 and "wrote 1 rows" in out
    rc, _, err = run([str(tmp_path / "dd"), str(tmp_path / "o3.jsonl"), *OPTS, "--split", "dev"], capsys)
    assert rc == 1 and "no split 'dev'" in err


def test_chat_system_prompt_and_limit(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    src.write_text("".join(json.dumps({"prompt": f"q{i}", "label": i}) + "\n" for i in range(5)))
    rc, out, _ = run([str(src), dst, "--chat", "--system-prompt", "Think.", "--limit", "2"], capsys)
    assert rc == 0 and "wrote 2 rows" in out
    assert read_out(dst)[1] == {"prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": "q1"}],
                                "label": "1", "metadata": {}}
    rc, _, err = run([str(src), str(tmp_path / "x.jsonl"), "--system-prompt", "s"], capsys)
    assert rc == 1 and "--system-prompt needs --chat" in err


def test_chat_prompts_are_validated(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    src.write_text(json.dumps({"prompt": [{"role": "bot", "content": "x"}], "label": "1"}) + "\n"
                   + json.dumps({"prompt": [{"role": "user", "content": "x"}], "label": "1"}) + "\n"
                   + '{"prompt": "broken"\n')
    rc, out, _ = run([str(src), dst], capsys)
    assert rc == 0 and "line 1: prompt[0]: unknown chat role 'bot'" in out
    assert "line 3: invalid JSON" in out and len(read_out(dst)) == 1


def test_missing_column_names_existing_columns(tmp_path, capsys):
    src = tmp_path / "in.csv"
    write_delimited(src, ",")
    rc, _, err = run([str(src), str(tmp_path / "o.jsonl"), "--input-col", "prompt"], capsys)
    assert rc == 1 and "no column 'prompt', 'label' (columns: question, answer, level, src)" in err
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_refuses_to_overwrite_and_never_leaves_partial_output(tmp_path, capsys, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "p", "label": "l"}) + "\n")
    dst.write_text("precious\n")
    rc, _, err = run([str(src), str(dst)], capsys)
    assert rc == 1 and "exists; pass --overwrite" in err and dst.read_text() == "precious\n"

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(C.os, "fsync", boom)
    rc, _, err = run([str(src), str(dst), "--overwrite"], capsys)
    assert rc == 1 and "disk full" in err
    assert dst.read_text() == "precious\n" and sorted(os.listdir(tmp_path)) == ["in.jsonl", "out.jsonl"]
    monkeypatch.undo()
    assert run([str(src), str(dst), "--overwrite"], capsys)[0] == 0 and read_out(dst)[0]["label"] == "l"


def test_all_rows_rejected_or_empty_is_an_error(tmp_path, capsys):
    src = tmp_path / "in.csv"
    src.write_text("prompt,label\n,1\n")
    rc, _, err = run([str(src), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and "no rows to write (all rejected, e.g. line 2: empty prompt)" in err
    assert not os.path.exists(tmp_path / "o.jsonl")
    (tmp_path / "e.jsonl").write_text("")
    rc, _, err = run([str(tmp_path / "e.jsonl"), str(tmp_path / "o.jsonl"), "--no-label"], capsys)
    assert rc == 1 and "no column 'prompt'" in err


def test_bad_inputs(tmp_path, capsys):
    rc, _, err = run([str(tmp_path / "nope.csv"), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and "no such file" in err
    (tmp_path / "x.txt").write_text("hi")
    rc, _, err = run([str(tmp_path / "x.txt"), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and "pass --format" in err
    (tmp_path / "l.json").write_text('[{"prompt": "a",}]')
    rc, _, err = run([str(tmp_path / "l.json"), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and "l.json:1: invalid JSON" in err


def test_module_entry_point(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    cmd = [sys.executable, "-m", "slime_hydra.data", "convert", str(src), str(dst), "--input-col", "question",
           "--label-col", "answer"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0 and "wrote 1 rows" in p.stdout
    p = subprocess.run([sys.executable, "-m", "slime_hydra.data", "check", str(dst)], capture_output=True, text=True)
    assert p.returncode == 0 and "1 rows ok" in p.stdout
    p = subprocess.run([sys.executable, "-m", "slime_hydra.data", "check", str(src)], capture_output=True, text=True)
    assert p.returncode == 1 and "missing key 'prompt'" in p.stderr


@pytest.mark.parametrize("name", ["in.csv", "in.tsv", "in.json"])
def test_not_utf8_names_file_and_line(tmp_path, capsys, name):
    src, dst = tmp_path / name, tmp_path / "o.jsonl"
    text = {"in.csv": "prompt,label\nok,1\ncaf\xe9,2\n", "in.tsv": "prompt\tlabel\nok\t1\ncaf\xe9\t2\n",
            "in.json": '{"prompt": "ok", "label": 1}\n{"prompt": "caf\xe9", "label": 2}\n'}[name]
    src.write_bytes(text.encode("latin-1"))
    rc, _, err = run([str(src), str(dst)], capsys)
    line = 2 if name == "in.json" else 3
    assert rc == 1 and f"{src}:{line}: not UTF-8 text (byte 0xe9" in err and "must be UTF-8" in err
    assert "Traceback" not in err and not dst.exists()


def qa_csv(path, n, changes=None):
    """A ``question,answer`` CSV of n rows; changes: {data row index: raw line} (row i is on line i + 2)."""
    lines = [f"{i}+0=,{i}" for i in range(n)]
    for i, raw in (changes or {}).items():
        lines[i] = raw
    path.write_text("question,answer\n" + "\n".join(lines) + "\n")


QA = ["--input-col", "question", "--label-col", "answer"]


def test_csv_stray_quote_to_end_of_file_is_an_error(tmp_path, capsys):
    # the csv module's default read everything after the quote as one field: "wrote 10 rows", exit 0
    src, dst = tmp_path / "in.csv", tmp_path / "o.jsonl"
    qa_csv(src, 1000, {10: '"10=,0'})
    dst.write_text("precious\n")
    rc, out, err = run([str(src), str(dst), *QA, "--overwrite"], capsys)
    assert rc == 1 and out == "" and "Traceback" not in err
    assert f"{src}:12: a quoted field opens here and is never closed (it runs to the end of the file, line 1001)" in err
    assert "expected a closing '\"'" in err and dst.read_text() == "precious\n"
    tsv = tmp_path / "in.tsv"
    tsv.write_text('prompt\tlabel\nq\t1\n"q2\t2\nq3\t3\n')
    rc, _, err = run([str(tsv), str(tmp_path / "t.jsonl")], capsys)
    assert rc == 1 and f"{tsv}:3: a quoted field opens here and is never closed" in err
    hdr = tmp_path / "h.csv"
    hdr.write_text('"prompt,label\nq,1\n')
    rc, _, err = run([str(hdr), str(tmp_path / "h.jsonl")], capsys)
    assert rc == 1 and f"{hdr}:1: a quoted field opens here and is never closed" in err


def test_csv_quote_closed_mid_field_is_an_error(tmp_path, capsys):
    src = tmp_path / "in.csv"
    qa_csv(src, 1000, {10: '"10=,0', 500: '5"00=,1'})
    rc, _, err = run([str(src), str(tmp_path / "o.jsonl"), *QA], capsys)
    assert rc == 1 and f"{src}:12: the quoted field that opens here ends at a '\"' on line 502 followed by" in err
    assert "expected ',' or the end of the line after a closing '\"'" in err
    src.write_text('prompt,label\n"hi" there,1\n')
    rc, _, err = run([str(src), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and f"{src}:2: the quoted field that opens here ends at a '\"' on line 2" in err


def test_csv_quotes_that_pair_up_are_valid_but_a_long_record_is_noted(tmp_path, capsys):
    # two stray quotes that close at a field boundary are valid CSV: the rows between are one field
    src, dst = tmp_path / "in.csv", str(tmp_path / "o.jsonl")
    qa_csv(src, 1000, {10: '"10=,0', 500: '500=",1'})
    rc, out, _ = run([str(src), dst, *QA], capsys)
    assert rc == 0 and "wrote 510 rows" in out
    assert "note: line 12: one record spans lines 12-502: a quoted field runs from line 12 to 502" in out
    # legitimate quoting: embedded newlines, delimiters and "" escapes, a quote inside an unquoted field
    src.write_text('prompt,label\n"two\nlines, a comma",1\n"say ""hi""",2\nplain "quote" inside,3\n\nq,4\n')
    rc, out, _ = run([str(src), dst, "--overwrite"], capsys)
    assert rc == 0 and "rejected 0" in out and "note" not in out
    assert [r["prompt"] for r in read_out(dst)] == ["two\nlines, a comma", 'say "hi"', 'plain "quote" inside', "q"]
    src.write_text("prompt,label\n\n,1\n\nq,2\n")  # blank lines are skipped and still counted
    rc, out, _ = run([str(src), dst, "--overwrite"], capsys)
    assert rc == 0 and "line 3: empty prompt" in out


def test_csv_field_over_the_csv_module_limit_is_read(tmp_path, capsys):
    # a long-context prompt: the csv module's default field_size_limit (131072) raised a traceback
    src, dst = tmp_path / "in.csv", str(tmp_path / "o.jsonl")
    long = "x" * 300_000
    src.write_text(f'prompt,label\n{long},1\n"{long}\n{long}",2\nq,3\n')
    before = C.csv.field_size_limit()
    rc, out, _ = run([str(src), dst], capsys)
    assert rc == 0 and "wrote 3 rows" in out and C.csv.field_size_limit() == before
    assert [len(r["prompt"]) for r in read_out(dst)] == [300_000, 600_001, 1]
    # ... and a stray quote in a file longer than the limit is still found where it opens
    qa_csv(src, 20_000, {10: '"10=,0'})
    rc, _, err = run([str(src), dst, "--overwrite", *QA], capsys)
    assert rc == 1 and f"{src}:12: a quoted field opens here and is never closed" in err


def test_output_folder_is_created_or_the_error_names_the_output(tmp_path, capsys, monkeypatch):
    # the recipe writes data/train.jsonl and a fresh clone has no data/: the error named a temp file
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "p", "label": "l"}) + "\n")
    dst = tmp_path / "data" / "sub" / "train.jsonl"
    rc, out, err = run([str(src), str(dst)], capsys)
    assert rc == 0 and f"wrote 1 rows to {dst}" in out and read_out(dst)[0]["label"] == "l"
    assert os.listdir(dst.parent) == ["train.jsonl"]
    monkeypatch.chdir(tmp_path)  # a relative path, as in the recipe
    rc, out, _ = run([str(src), "fresh/train.jsonl"], capsys)
    assert rc == 0 and read_out(tmp_path / "fresh" / "train.jsonl")[0]["prompt"] == "p"

    (tmp_path / "afile").write_text("")
    rc, _, err = run([str(src), str(tmp_path / "afile" / "x" / "o.jsonl")], capsys)
    assert rc == 1 and f"{tmp_path}/afile/x/o.jsonl: cannot create its folder {tmp_path}/afile/x: " in err
    assert f"{tmp_path}/afile is a file" in err and ".tmp" not in err
    rc, _, err = run([str(src), str(tmp_path / "data"), "--overwrite"], capsys)
    assert rc == 1 and f"{tmp_path}/data: is a folder; expected the path of the JSONL file to write" in err

    def boom(*a, **k):
        raise OSError(28, "No space left on device", "/somewhere/.o.jsonl.x.tmp")

    monkeypatch.setattr(C.os, "fsync", boom)  # a failed write names OUT and removes the folders it made
    dst = tmp_path / "new" / "deeper" / "o.jsonl"
    rc, _, err = run([str(src), str(dst)], capsys)
    assert rc == 1 and f"{dst}: cannot write it (No space left on device)" in err and ".tmp" not in err
    assert not (tmp_path / "new").exists()


def test_bad_input_never_ends_in_a_traceback(tmp_path, capsys, monkeypatch):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = run([str(deep), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 1 and f"{deep}: JSON nested too deeply to read" in err
    lines = tmp_path / "deep.jsonl"
    lines.write_text(json.dumps({"prompt": "p", "label": "l"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    rc, out, _ = run([str(lines), str(tmp_path / "o.jsonl")], capsys)
    assert rc == 0 and "line 2: JSON nested too deeply to read" in out

    def csv_error(*a, **k):  # whatever else the csv module raises is reported, not a traceback
        raise C.csv.Error("something new")

    src = tmp_path / "in.csv"
    src.write_text("prompt,label\nq,1\n")
    monkeypatch.setattr(C.csv, "reader", csv_error)
    rc, _, err = run([str(src), str(tmp_path / "c.jsonl")], capsys)
    assert rc == 1 and f"error: {src}: something new" in err


def test_json_lines_with_unicode_line_separators_in_strings(tmp_path, capsys):
    # our own output keeps U+2028 unescaped (ensure_ascii=False); reading it back split the line there
    src, dst = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    src.write_text(json.dumps({"prompt": "a\u2028b\u2029c\x85d", "label": 1}, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    rc, out, _ = run([str(src), str(dst)], capsys)
    assert rc == 0 and "wrote 1 rows" in out and read_out(dst)[0]["prompt"] == "a\u2028b\u2029c\x85d"
    rc, out, _ = run([str(dst), str(tmp_path / "again.jsonl")], capsys)
    assert rc == 0 and "wrote 1 rows" in out


def test_json_without_objects_says_why(tmp_path, capsys):
    src, dst = tmp_path / "in.json", str(tmp_path / "o.jsonl")
    src.write_text(json.dumps({"data": [{"prompt": "p", "label": "l"}]}, indent=2))
    rc, _, err = run([str(src), dst], capsys)
    assert rc == 1 and f"{src}: one JSON object; expected a JSON list of objects, or JSON lines" in err
    src.write_text("[1, 2]")
    rc, _, err = run([str(src), dst], capsys)
    assert rc == 1 and f"{src}: no JSON objects to read (item 0: expected an object, got int)" in err
    src.write_text("not json\n")
    rc, _, err = run([str(src), dst], capsys)
    assert rc == 1 and f"{src}: no JSON objects to read (line 1: invalid JSON (Expecting value at column 1))" in err
