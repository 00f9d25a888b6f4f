"""Reading prompt datasets (JSONL / JSON / parquet) into validated ``Row``s, and rendering prompts.

A row has a prompt (a string or chat messages), a label, optional metadata and tools. All is validated at
load time; a ``DataError`` names the file and line or row (``data.parquet[5]``) and what was expected.
``path@[start:end]`` selects rows with Python slice semantics; rows outside the slice are not parsed.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

CHAT_ROLES = ("system", "user", "assistant", "tool")
SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


class DataError(ValueError):
    """A dataset file or row that does not match what is expected; the message says where."""


@dataclass
class Row:
    prompt: Union[str, List[Dict[str, Any]]]
    label: Any
    metadata: Dict[str, Any]
    tools: Optional[List[Dict[str, Any]]]
    source: str  # "file:line" (JSONL) or "file[row]" (parquet, JSON list)


def split_slice(spec: str) -> Tuple[str, slice]:
    """``"data.jsonl@[10:-5]"`` -> ``("data.jsonl", slice(10, -5))``; no suffix -> ``slice(None)``;
    ``~`` in the path is expanded."""
    m = SLICE_RE.match(spec)
    if (not m and "@[" in spec) or (m and "-" in (m["start"], m["end"])):
        raise DataError(f"{spec}: bad row slice; expected path@[start:end], e.g. data.jsonl@[0:1000]")
    if not m:
        return os.path.expanduser(spec), slice(None)
    return os.path.expanduser(m["path"]), slice(*(int(x) if x else None for x in (m["start"], m["end"])))


def read_text(path: str, kind: str = "JSON and JSONL datasets") -> str:
    """A file's text; one that is not UTF-8 is a DataError naming the line and the byte (``kind``: what
    the message calls such files)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}: {e.reason}); "
                        f"{kind} must be UTF-8 (a binary file, or another encoding: convert it "
                        "with iconv, or save it as parquet)") from None


def json_loads(text: str, loc: str, whole: bool = False) -> Any:
    """``json.loads``; bad JSON is a DataError at ``loc`` (``whole``: a file, the error's line is added)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{loc}{f':{e.lineno}' if whole else ''}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{loc}: JSON nested too deeply to read") from None


def _jsonl_records(path: str, sl: slice, text: Optional[str] = None) -> Iterable[Tuple[str, Any]]:
    """(location, parsed object) for the selected non-blank lines of a JSON-lines file."""
    text = read_text(path) if text is None else text
    # lines as a text file splits them (str.splitlines would also split at U+2028 inside a JSON string)
    lines = [(i, line) for i, line in enumerate(io.StringIO(text, newline=None), 1) if line.strip()]
    for lineno, line in lines[sl]:
        yield f"{path}:{lineno}", json_loads(line, f"{path}:{lineno}")


def _json_records(path: str, sl: slice) -> Iterable[Tuple[str, Any]]:
    """A ``.json`` file: a JSON list of objects, or JSON lines."""
    text = read_text(path)
    if not text.lstrip().startswith("["):
        yield from _jsonl_records(path, sl, text)
        return
    data = json_loads(text, path, whole=True)
    for i in range(len(data))[sl]:
        yield f"{path}[{i}]", data[i]


def _parquet_records(path: str, sl: slice) -> Iterable[Tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet ({e})") from None
    idx = range(table.num_rows)[sl]  # step 1: the slice syntax has no step
    for i, rec in zip(idx, table.slice(idx.start, len(idx)).to_pylist()):
        yield f"{path}[{i}]", _drop_none_struct_fields(rec)


def _drop_none_struct_fields(rec: Dict[str, Any]) -> Dict[str, Any]:
    """Drop the None fields parquet structs give every message (chat templates test ``is defined``)."""
    for k, v in rec.items():
        if isinstance(v, list) and v and all(isinstance(m, dict) and "role" in m for m in v):
            rec[k] = [{f: x for f, x in m.items() if x is not None or f in ("role", "content")} for m in v]
    return rec


READERS = {".jsonl": _jsonl_records, ".json": _json_records, ".parquet": _parquet_records}


def read_rows(spec: str, *, input_key: str = "prompt", label_key: Optional[str] = "label",
              metadata_key: Optional[str] = "metadata", tools_key: Optional[str] = "tools") -> List[Row]:
    """Read and validate the rows of ``spec`` (``path`` or ``path@[start:end]``)."""
    path, sl = split_slice(spec)
    ext = os.path.splitext(path)[1].lower()
    if ext not in READERS:
        raise DataError(f"{path}: unsupported file type {ext or '(none)'!r}; expected one of {sorted(READERS)} "
                        f"(convert other formats with `python -m slime_hydra.data convert`)")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    rows = [parse_row(obj, loc, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                      tools_key=tools_key) for loc, obj in READERS[ext](path, sl)]
    if not rows:
        raise DataError(f"{spec}: no rows")
    return rows


def rows_from_dicts(records: Sequence[Dict[str, Any]], source: str, **keys: Any) -> List[Row]:
    """Validate in-memory records (e.g. the built-in tasks); locations are ``source[i]``."""
    return [parse_row(r, f"{source}[{i}]", **keys) for i, r in enumerate(records)]


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def parse_row(obj: Any, loc: str, *, input_key: str = "prompt", label_key: Optional[str] = "label",
              metadata_key: Optional[str] = "metadata", tools_key: Optional[str] = "tools") -> Row:
    """One record -> a validated ``Row``; ``loc`` prefixes every error. Chat messages ending with the assistant's
    turn, and no ``label_key``: that turn is the label, the messages before it the prompt."""
    if not isinstance(obj, dict):
        raise DataError(f"{loc}: expected a JSON object, got {_type_name(obj)}")

    def missing(key: str, setting: str) -> DataError:
        return DataError(f"{loc}: missing key {key!r} (keys here: {', '.join(map(str, obj)) or 'none'}); set "
                         f"{setting} to the key that holds it")

    if input_key not in obj:
        raise missing(input_key, "data.input_key (an eval set's: its input_key)")
    prompt = check_prompt(obj[input_key], loc, input_key)
    label = None
    if label_key is not None:
        last = prompt[-1] if isinstance(prompt, list) else {}
        if label_key not in obj and last.get("role") == "assistant" and isinstance(last.get("content"), str) \
                and len(prompt) > 1:  # a conversation whose last turn is the target (SFT data)
            prompt, label = prompt[:-1], last["content"]
        elif label_key not in obj:
            raise missing(label_key, "data.label_key (an eval set's: its label_key), or data.label_key=null for a "
                          "reward that needs no label")
        else:
            label = obj[label_key]
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise DataError(f"{loc}: {label_key} must be a string or number, got {_type_name(label)}")
        if isinstance(label, float) and math.isnan(label):
            raise DataError(f"{loc}: {label_key} is NaN (a missing value?)")
    metadata: Dict[str, Any] = {}
    if metadata_key is not None and obj.get(metadata_key) is not None:
        metadata = _maybe_json(obj[metadata_key], loc, metadata_key)
        if not isinstance(metadata, dict):
            raise DataError(f"{loc}: {metadata_key} must be an object, got {_type_name(metadata)}")
    tools = None
    if tools_key is not None and obj.get(tools_key) is not None:
        tools = _maybe_json(obj[tools_key], loc, tools_key)
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DataError(f"{loc}: {tools_key} must be a list of objects (tool schemas), got {_type_name(tools)}")
    return Row(prompt=prompt, label=label, metadata=metadata, tools=tools, source=loc)


def _maybe_json(value: Any, loc: str, key: str) -> Any:
    """Metadata / tools stored as a JSON string (common in parquet, whose structs need one schema)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{loc}: {key} is a string but not valid JSON ({e.msg})") from None


def check_prompt(prompt: Any, loc: str, key: str) -> Union[str, List[Dict[str, Any]]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{loc}: {key} is empty")
        return prompt
    if not isinstance(prompt, list):
        raise DataError(f"{loc}: {key} must be a string or a list of chat messages, got {_type_name(prompt)}")
    if not prompt:
        raise DataError(f"{loc}: {key} is an empty list of chat messages")
    for i, m in enumerate(prompt):
        where = f"{loc}: {key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: a chat message must be an object with role and content, got {_type_name(m)}")
        if "role" not in m:
            raise DataError(f"{where}: chat message has no 'role' (keys here: {', '.join(m) or 'none'})")
        if m["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: unknown chat role {m['role']!r} (expected {', '.join(CHAT_ROLES)})")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise DataError(f"{where}: chat message has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"{where}: content must be a string or a list of parts, got {_type_name(content)}")
    return prompt


def render_prompt(row: Row, tokenizer: Any, *, apply_chat_template: bool,
                  chat_template_kwargs: Optional[Dict[str, Any]] = None,
                  system_prompt: Optional[str] = None) -> str:
    """The text sent to the engine. A string prompt stays as is unless ``apply_chat_template`` (then it is one
    user message); a chat prompt needs the template. ``system_prompt`` is prepended unless one starts it."""
    if not apply_chat_template:
        if not isinstance(row.prompt, str):
            raise DataError(f"{row.source}: the prompt is a list of chat messages; set data.apply_chat_template=true "
                            "to render it")
        if system_prompt is not None:
            raise DataError(f"{row.source}: data.system_prompt needs data.apply_chat_template=true")
        return row.prompt
    messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else list(row.prompt)
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{row.source}: data.apply_chat_template=true but the tokenizer has no chat template; set "
                        "data.apply_chat_template=false for text prompts, or model.tokenizer to one with a chat "
                        "template (an instruct model's)")
    try:
        text = tokenizer.apply_chat_template(messages, tools=row.tools, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
    except Exception as e:  # jinja errors (raise_exception in templates, undefined fields)
        raise DataError(f"{row.source}: the chat template failed: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):  # pragma: no cover - depends on the transformers version
        raise DataError(f"{row.source}: apply_chat_template returned {_type_name(text)}, expected str")
    return text


def filter_long_prompts(prompts: List[str], tokenizer: Any, max_len: Optional[int]) -> Tuple[List[int], int]:
    """Indices of the prompts of at most ``max_len`` tokens (without special tokens, as the engine gets them),
    and how many were dropped."""
    if max_len is None or not prompts:
        return list(range(len(prompts))), 0
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    kept = [i for i, t in enumerate(ids) if len(t) <= max_len]
    return kept, len(prompts) - len(kept)
