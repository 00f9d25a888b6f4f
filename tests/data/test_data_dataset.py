"""read_rows (formats, slices, validation errors), render_prompt, filter_long_prompts."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime_hydra.data.dataset import DataError, Row, filter_long_prompts, read_rows, render_prompt, split_slice
from slime_hydra.data.tokenizer import builtin_tokenizer

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "prompts.jsonl")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------ formats
def test_jsonl_fixture_rows_and_sources():
    rows = read_rows(FIXTURE)
    assert [r.label for r in rows] == ["2", "Paris", "sunny", 5]
    assert rows[0].metadata == {"rm_type": "math"} and rows[1].metadata == {}
    assert rows[1].tools is None and rows[2].tools[0]["function"]["name"] == "get_weather"
    assert isinstance(rows[2].prompt, list)
    assert [r.source.rsplit(":", 1)[1] for r in rows] == ["1", "2", "4", "5"]  # true line numbers (line 3 blank)


def test_json_list_and_json_lines(tmp_path):
    recs = [{"prompt": f"p{i}", "label": str(i)} for i in range(3)]
    (tmp_path / "a.json").write_text(json.dumps(recs, indent=2))
    rows = read_rows(str(tmp_path / "a.json"))
    assert [r.prompt for r in rows] == ["p0", "p1", "p2"] and rows[1].source.endswith("a.json[1]")
    write_jsonl(tmp_path / "b.json", recs)
    assert [r.label for r in read_rows(str(tmp_path / "b.json"))] == ["0", "1", "2"]


def test_parquet_with_chat_structs_and_json_string_metadata(tmp_path):
    table = pa.table({
        "prompt": [[{"role": "user", "content": "hi", "tool_calls": None}], [{"role": "user", "content": "yo"}]],
        "label": ["a", "b"],
        "metadata": [json.dumps({"rm_type": "exact"}), None],
    })
    path = str(tmp_path / "d.parquet")
    pq.write_table(table, path)
    rows = read_rows(path)
    assert rows[0].prompt == [{"role": "user", "content": "hi"}]  # None struct fields dropped
    assert rows[0].metadata == {"rm_type": "exact"} and rows[1].metadata == {}
    assert rows[1].source == f"{path}[1]"
    assert [r.label for r in read_rows(path + "@[1:]")] == ["b"]


def test_custom_keys_and_no_label(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q?", "answer": 3, "extra": {"a": 1}}])
    row = read_rows(path, input_key="question", label_key="answer", metadata_key="extra", tools_key=None)[0]
    assert (row.prompt, row.label, row.metadata) == ("q?", 3, {"a": 1})
    assert read_rows(path, input_key="question", label_key=None)[0].label is None


# ------------------------------------------------------------------------------------- slices
@pytest.mark.parametrize("suffix, expected", [
    ("", list(range(10))), ("@[2:5]", [2, 3, 4]), ("@[:3]", [0, 1, 2]), ("@[7:]", [7, 8, 9]),
    ("@[-2:]", [8, 9]), ("@[:-8]", [0, 1]), ("@[3:100]", list(range(3, 10))),
])
def test_slices(tmp_path, suffix, expected):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"p{i}", "label": i} for i in range(10)])
    assert [r.label for r in read_rows(path + suffix)] == expected


def test_slice_parsing():
    assert split_slice("a/b.jsonl@[1:-1]") == ("a/b.jsonl", slice(1, -1))
    assert split_slice("x.jsonl") == ("x.jsonl", slice(None))
    assert split_slice("~/x.jsonl@[2:]") == (os.path.expanduser("~/x.jsonl"), slice(2, None))  # as the shell would
    with pytest.raises(DataError, match="bad row slice"):
        split_slice("x.jsonl@[a:b]")


def test_empty_slice_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "p", "label": "l"}])
    with pytest.raises(DataError, match=r"@\[5:\]: no rows"):
        read_rows(path + "@[5:]")


# ------------------------------------------------------------------------------------- errors
def bad(tmp_path, text, name="data.jsonl", **kw):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as e:
        read_rows(str(path), **kw)
    return str(e.value).replace(str(tmp_path) + os.sep, "")


def test_malformed_json_names_line_and_column(tmp_path):
    msg = bad(tmp_path, '{"prompt": "a", "label": "b"}\n{"prompt": "a" "label": "b"}\n')
    assert msg == "data.jsonl:2: invalid JSON (Expecting ',' delimiter at column 16)"


def test_missing_key_lists_keys_here(tmp_path):
    msg = bad(tmp_path, '{"question": "q", "answer": "a"}\n')
    assert msg == ("data.jsonl:1: missing key 'prompt' (keys here: question, answer); set data.input_key (an eval "
                   "set's: its input_key) to the key that holds it")
    msg = bad(tmp_path, '{"prompt": "q", "answer": "a"}\n')
    assert msg.startswith("data.jsonl:1: missing key 'label' (keys here: prompt, answer); set data.label_key")
    assert "data.label_key=null for a reward that needs no label" in msg


def test_empty_file(tmp_path):
    assert bad(tmp_path, "\n\n") == "data.jsonl: no rows"


@pytest.mark.parametrize("label, got", [([1, 2], "list"), (None, "null"), (True, "bool"), ({"a": 1}, "dict")])
def test_wrong_label_type(tmp_path, label, got):
    msg = bad(tmp_path, json.dumps({"prompt": "p", "label": label}) + "\n")
    assert msg == f"data.jsonl:1: label must be a string or number, got {got}"


def test_unknown_chat_role(tmp_path):
    msg = bad(tmp_path, json.dumps({"prompt": [{"role": "bot", "content": "x"}], "label": "l"}) + "\n")
    assert msg == "data.jsonl:1: prompt[0]: unknown chat role 'bot' (expected system, user, assistant, tool)"


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "   ", "label": "l"}, "prompt is empty"),
    ({"prompt": [], "label": "l"}, "empty list of chat messages"),
    ({"prompt": 5, "label": "l"}, "must be a string or a list of chat messages, got int"),
    ({"prompt": [{"content": "x"}], "label": "l"}, "has no 'role'"),
    ({"prompt": [{"role": "user"}], "label": "l"}, "has no 'content'"),
    ({"prompt": "p", "label": "l", "metadata": [1]}, "metadata must be an object, got list"),
    ({"prompt": "p", "label": "l", "tools": {"a": 1}}, "tools must be a list of objects"),
    ({"prompt": "p", "label": float("nan")}, "NaN"),
])
def test_other_row_errors(tmp_path, row, needle):
    assert needle in bad(tmp_path, json.dumps(row) + "\n")


def test_file_level_errors(tmp_path):
    assert "unsupported file type '.csv'" in bad(tmp_path, "a,b\n", name="data.csv")
    with pytest.raises(DataError, match="no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    assert bad(tmp_path, '[{"prompt": 1,}]', name="d.json").startswith("d.json:1: invalid JSON")
    assert bad(tmp_path, '["x"]', name="d.json") == "d.json[0]: expected a JSON object, got str"


# ---------------------------------------------------------------------------------- rendering
TOOL_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }}{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer("builtin:digits")


@pytest.fixture(scope="module")
def tool_tok():
    t = builtin_tokenizer("builtin:digits")
    t.chat_template = TOOL_TEMPLATE
    return t


def row(prompt, tools=None):
    return Row(prompt=prompt, label="1", metadata={}, tools=tools, source="f.jsonl:1")


def test_string_prompt_stays_raw(tok):
    assert render_prompt(row("12345="), tok, apply_chat_template=False, chat_template_kwargs={}, system_prompt=None) \
        == "12345="


def test_builtin_chat_template(tok):
    out = render_prompt(row("12="), tok, apply_chat_template=True, chat_template_kwargs={}, system_prompt="9")
    assert out == "9|12="  # the builtin template joins contents with "|"


def test_tools_system_prompt_and_kwargs(tool_tok):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    r = row([{"role": "user", "content": "hi"}], tools=tools)
    out = render_prompt(r, tool_tok, apply_chat_template=True, chat_template_kwargs={"enable_thinking": False},
                        system_prompt="sys")
    assert out == "[tools:calc]<system>sys<user>hi<assistant><no_think>"
    # an existing system message is kept, not doubled
    r2 = row([{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}])
    out = render_prompt(r2, tool_tok, apply_chat_template=True, chat_template_kwargs={}, system_prompt="sys")
    assert out == "<system>mine<user>hi<assistant>"


def test_render_errors(tok):
    with pytest.raises(DataError, match=r"f.jsonl:1: .*set data.apply_chat_template=true"):
        render_prompt(row([{"role": "user", "content": "x"}]), tok, apply_chat_template=False,
                      chat_template_kwargs={}, system_prompt=None)
    with pytest.raises(DataError, match="system_prompt needs data.apply_chat_template"):
        render_prompt(row("x"), tok, apply_chat_template=False, chat_template_kwargs={}, system_prompt="s")
    no_template = builtin_tokenizer("builtin:digits")
    no_template.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(row("x"), no_template, apply_chat_template=True, chat_template_kwargs={}, system_prompt=None)
    failing = builtin_tokenizer("builtin:digits")
    failing.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(DataError, match="f.jsonl:1: the chat template failed: .*only user turns"):
        render_prompt(row("x"), failing, apply_chat_template=True, chat_template_kwargs={}, system_prompt=None)


def test_filter_long_prompts(tok):
    kept, dropped = filter_long_prompts(["12", "12345", "1", "123"], tok, 3)
    assert kept == [0, 2, 3] and dropped == 1
    assert filter_long_prompts(["12345"], tok, None) == ([0], 0)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json"])
def test_a_file_that_is_not_utf8_is_an_error_naming_it(tmp_path, name):
    """A binary file (or a latin-1 export) named as a dataset: a DataError with the file, the line and
    the byte, like every other data error, not a bare UnicodeDecodeError."""
    path = tmp_path / name
    path.write_bytes(b'{"prompt": "ok", "label": "1"}\n' + bytes(range(128, 256)) + b"\x00\x01PK\x03\x04")
    with pytest.raises(DataError, match=rf"{name}:2: not UTF-8 text \(byte 0x80 at offset 31"):
        read_rows(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_nested_too_deeply_names_the_file(tmp_path, suffix):
    deep = "[" * 100_000 + "]" * 100_000
    f = tmp_path / f"deep{suffix}"
    f.write_text(deep + "\n" if suffix == ".json" else f'{{"prompt": {deep}, "label": "x"}}\n')
    with pytest.raises(DataError, match="nested too deeply to read") as e:
        read_rows(str(f))
    assert str(f) in str(e.value)
