"""Convert a dataset into our JSONL: ``{"prompt": str | [messages], "label": str, "metadata": {...}}``.

    slime-hydra-convert IN OUT [--input-col question] [--label-col answer] [--metadata-cols a,b]
                        [--chat] [--system-prompt "..."] [--split train] [--limit N] [--overwrite]

IN is CSV, TSV, JSON (a list of objects, or JSON lines), JSONL, parquet, or a ``save_to_disk`` directory
(a DatasetDict needs ``--split``). Bad rows are skipped and listed with their line or (0-based) row; a bad
file (not UTF-8, a CSV quote left open) or a missing column stops the conversion. OUT appears only when
complete (a missing folder is created) and an existing OUT is kept unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from slime_hydra.data.dataset import DataError, check_prompt, json_loads, read_text

FORMATS = ("csv", "tsv", "json", "jsonl", "parquet", "hf")
MAX_LISTED = 20  # rejected rows (and notes) printed in the summary
LONG_RECORD = 100  # a CSV / TSV record spanning more lines than this is noted (a stray quote?)


class ConvertError(ValueError):
    """The input cannot be converted at all (unreadable file, missing column, bad options)."""


class Reject(ValueError):
    """One row is skipped; the message is the reason."""


@dataclass
class Note:
    """Not a row: something about the input the summary points out (the next row is still read)."""

    text: str


@dataclass
class Summary:
    written: int = 0
    rejected: List[Tuple[str, str]] = field(default_factory=list)  # (location, reason)
    notes: List[Tuple[str, str]] = field(default_factory=list)  # (location, what to look at)

    def report(self, out: str) -> str:
        lines = [f"wrote {self.written} rows to {out}; rejected {len(self.rejected)}"]
        for prefix, items in (("  ", self.rejected), ("note: ", self.notes)):
            lines += [f"{prefix}{loc}: {why}" for loc, why in items[:MAX_LISTED]]
            if len(items) > MAX_LISTED:
                lines.append(f"{prefix}... and {len(items) - MAX_LISTED} more")
        return "\n".join(lines)


Records = Tuple[List[str], Iterator[Tuple[str, Any]]]  # (columns, (location, record or Reject))


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        return "hf"
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise ConvertError(f"{path}: cannot tell the format from {('.' + ext) if ext else 'a missing extension'}; "
                           f"pass --format ({', '.join(FORMATS)})")
    return ext


class _Lines:
    """The lines of a text, counted, with the raw lines of the record being read (for error messages)."""

    def __init__(self, text: str):
        self._it = iter(io.StringIO(text, newline=""))  # the line breaks the csv module counts
        self.chars, self.count, self.record = len(text), 0, []

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> str:
        line = next(self._it)
        self.count += 1
        self.record.append(line)
        return line


def _quoted_fields(lines: List[str], delimiter: str, first: int) -> List[Tuple[int, Optional[int]]]:
    """(line it opens on, line it closes on or None) of each quoted field in a record's raw lines, scanned
    as the csv module reads them."""
    spans: List[Tuple[int, Optional[int]]] = []
    opened, in_quotes, at_start = first, False, True
    for n, line in enumerate(lines, first):
        j = 0
        while j < len(line):
            c = line[j]
            if in_quotes:
                if c == '"':
                    if line.startswith('"', j + 1):
                        j += 1
                    else:
                        in_quotes = False
                        spans.append((opened, n))
            elif c == '"' and at_start:
                in_quotes, opened = True, n
            at_start = not in_quotes and c in (delimiter, "\r", "\n")
            j += 1
    if in_quotes:
        spans.append((opened, None))
    return spans


def _csv_error(path: str, e: csv.Error, lines: _Lines, first: int, delimiter: str) -> ConvertError:
    """A csv.Error as the file, the line where the bad quoted field opens, and what was expected."""
    spans = _quoted_fields(lines.record, delimiter, first)
    sep = "','" if delimiter == "," else "a tab" if delimiter == "\t" else repr(delimiter)
    escape = "a '\"' inside a quoted field is written '\"\"'"
    if "unexpected end of data" in str(e) and spans and spans[-1][1] is None:
        return ConvertError(f"{path}:{spans[-1][0]}: a quoted field opens here and is never closed (it runs to the end "
                            f"of the file, line {lines.count}); expected a closing '\"' ({escape}), or no '\"' at the "
                            "start of the field")
    if "expected after" in str(e) and spans:
        return ConvertError(f"{path}:{spans[-1][0]}: the quoted field that opens here ends at a '\"' on line "
                            f"{spans[-1][1]} followed by more text; expected {sep} or the end of the line after a "
                            f"closing '\"' ({escape})")
    return ConvertError(f"{path}:{lines.count}: not valid {'CSV' if delimiter == ',' else 'TSV'} ({e})")


def _read_delimited(path: str, delimiter: str) -> Records:
    """Rows of a CSV / TSV file, strict about quotes: a stray '"' would swallow every following line, so an
    unclosed or misplaced quote is an error naming the line where its field opens. csv.field_size_limit()
    is raised to the file's length while it is read: a long prompt may pass the default."""
    lines = _Lines(read_text(path, "CSV and TSV files"))
    reader = csv.reader(lines, delimiter=delimiter, strict=True)

    def next_row() -> Optional[Tuple[int, List[str]]]:
        """(first line, fields) of the next non-blank record, or None at the end."""
        while True:
            first, lines.record = lines.count + 1, []
            limit = csv.field_size_limit()
            csv.field_size_limit(max(limit, lines.chars + 1))
            try:
                row = next(reader)
            except StopIteration:
                return None
            except csv.Error as e:
                raise _csv_error(path, e, lines, first, delimiter) from None
            finally:
                csv.field_size_limit(limit)
            if row:
                return first, row

    header = next_row()
    columns = header[1] if header else []

    def rows() -> Iterator[Tuple[str, Any]]:
        while (got := next_row()) is not None:
            first, row = got
            loc = f"line {first}"
            if lines.count - first + 1 > LONG_RECORD:
                opened, closed = max(_quoted_fields(lines.record, delimiter, first),
                                     key=lambda s: (s[1] or 0) - s[0], default=(first, lines.count))
                yield loc, Note(f"one record spans lines {first}-{lines.count}: a quoted field runs from line {opened} "
                                f"to {closed}; if that is not meant, a stray '\"' on line {opened} opened it")
            if len(row) > len(columns):
                yield loc, Reject(f"{len(row)} fields, the header has {len(columns)}")
            else:
                yield loc, dict(zip(columns, row + [None] * (len(columns) - len(row))))

    return columns, rows()


def _read_json_lines(text: str) -> List[Tuple[str, Any]]:
    out = []
    for i, line in enumerate(io.StringIO(text, newline=None), 1):  # as training splits them (not at U+2028)
        if line.strip():
            try:
                out.append((f"line {i}", json_loads(line, "")))
            except DataError as e:
                out.append((f"line {i}", Reject(str(e).lstrip(": "))))
    return out


def _read_json(path: str) -> Records:
    text = read_text(path, "JSON and JSONL files")
    if text.lstrip().startswith("["):
        recs = [(f"item {i}", x) for i, x in enumerate(json_loads(text, path, whole=True))]
    else:
        recs = _read_json_lines(text)
    if recs and not any(isinstance(r, dict) for _, r in recs):  # say why, not "no column 'prompt'"
        try:
            whole = json.loads(text)
        except (ValueError, RecursionError):
            whole = None
        if isinstance(whole, dict):
            raise ConvertError(f"{path}: one JSON object; expected a JSON list of objects, or JSON lines (one "
                               "object per line)")
        loc, r = recs[0]
        why = r if isinstance(r, Reject) else f"expected an object, got {type(r).__name__}"
        raise ConvertError(f"{path}: no JSON objects to read ({loc}: {why})")
    columns = list(dict.fromkeys(k for _, r in recs if isinstance(r, dict) for k in r))
    return columns, iter(recs)


def _read_parquet(path: str) -> Records:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ConvertError(f"{path}: cannot read parquet ({e})") from None
    return table.column_names, ((f"row {i}", r) for i, r in enumerate(table.to_pylist()))


def _read_hf(path: str, split: Optional[str]) -> Records:
    try:
        import datasets
    except ImportError:
        raise ConvertError("reading a saved dataset directory needs the `datasets` package "
                           "(pip install 'slime_hydra[datasets]')") from None
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise ConvertError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise ConvertError(f"{path}: a DatasetDict; pick one with --split ({', '.join(ds)})")
        if split not in ds:
            raise ConvertError(f"{path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    elif split is not None:
        raise ConvertError(f"{path}: a single Dataset, not a DatasetDict; drop --split")
    return list(ds.column_names), ((f"row {i}", r) for i, r in enumerate(ds))


def read_records(path: str, fmt: Optional[str] = None, split: Optional[str] = None) -> Records:
    if not os.path.exists(path):
        raise ConvertError(f"{path}: no such file or directory")
    fmt = fmt or detect_format(path)
    if split is not None and fmt != "hf":
        raise ConvertError("--split is only for a saved datasets directory")
    try:
        if fmt in ("csv", "tsv"):
            return _read_delimited(path, "," if fmt == "csv" else "\t")
        if fmt in ("json", "jsonl"):
            return _read_json(path)
    except DataError as e:  # not UTF-8, bad JSON: named with the file and line
        raise ConvertError(str(e)) from None
    if fmt == "parquet":
        return _read_parquet(path)
    return _read_hf(path, split)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def label_text(v: Any) -> str:
    """A scalar label as text: ``5.0`` (ints read back as floats) -> ``"5"``."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise Reject(f"label must be a string or number, got {type(v).__name__}")
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v).strip() if isinstance(v, str) else str(v)


def convert_record(rec: Any, *, input_col: str, label_col: Optional[str], metadata_cols: Sequence[str], chat: bool,
                   system_prompt: Optional[str]) -> Dict[str, Any]:
    """One input record -> one output row; raises ``Reject`` with the reason."""
    if isinstance(rec, Reject):
        raise rec
    if not isinstance(rec, dict):
        raise Reject(f"expected an object, got {type(rec).__name__}")
    prompt = rec.get(input_col)
    if _missing(prompt):
        raise Reject("empty prompt" if input_col in rec else f"missing prompt column {input_col!r}")
    if isinstance(prompt, list):  # parquet / datasets give every message every struct field
        prompt = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")}
                  if isinstance(m, dict) else m for m in prompt]
    try:
        prompt = check_prompt(prompt, "", input_col)
    except DataError as e:
        raise Reject(str(e).lstrip(": ")) from None
    if isinstance(prompt, str) and chat:
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt is not None and prompt[0].get("role") != "system":
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    out: Dict[str, Any] = {"prompt": prompt}
    if label_col is not None:
        if _missing(rec.get(label_col)):
            raise Reject("missing label")
        out["label"] = label_text(rec[label_col])
    out["metadata"] = {c: (None if _missing(rec.get(c)) and not isinstance(rec.get(c), str) else rec.get(c))
                       for c in metadata_cols}
    return out


def convert(src: str, dst: str, *, input_col: str = "prompt", label_col: Optional[str] = "label",
            metadata_cols: Sequence[str] = (), chat: bool = False, system_prompt: Optional[str] = None,
            overwrite: bool = False, limit: Optional[int] = None, split: Optional[str] = None,
            fmt: Optional[str] = None) -> Summary:
    """Convert ``src`` to JSONL at ``dst``; raises ConvertError when nothing sensible can be written."""
    if problem := _output_problem(dst):
        raise ConvertError(f"{dst}: {problem}")
    if os.path.exists(dst) and not overwrite:
        raise ConvertError(f"{dst}: exists; pass --overwrite to replace it")
    if system_prompt is not None and not chat:
        raise ConvertError("--system-prompt needs --chat (a plain-text prompt has no system message; "
                           "or set data.system_prompt with data.apply_chat_template=true at train time)")
    if limit is not None and limit < 1:
        raise ConvertError(f"--limit must be >= 1, got {limit}")
    columns, records = read_records(src, fmt, split)
    if absent := [c for c in (input_col, label_col, *metadata_cols) if c is not None and c not in columns]:
        raise ConvertError(f"{src}: no column {', '.join(map(repr, absent))} (columns: {', '.join(columns) or 'none'})")
    summary, rows = Summary(), []
    for loc, rec in records:
        if isinstance(rec, Note):
            summary.notes.append((loc, rec.text))
            continue
        try:
            rows.append(convert_record(rec, input_col=input_col, label_col=label_col, metadata_cols=metadata_cols,
                                       chat=chat, system_prompt=system_prompt))
        except Reject as e:
            summary.rejected.append((loc, str(e)))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        listed = "; ".join(f"{loc}: {why}" for loc, why in summary.rejected[:3])
        raise ConvertError(f"{src}: no rows to write" + (f" (all rejected, e.g. {listed})" if listed else ""))
    write_jsonl_atomic(dst, rows)
    summary.written = len(rows)
    return summary


def _output_problem(dst: str) -> Optional[str]:
    """Why ``dst`` cannot be written (checked before any work), or None."""
    if os.path.isdir(dst):
        return "is a folder; expected the path of the JSONL file to write"
    folder = os.path.dirname(os.path.abspath(dst))
    missing = _missing_folders(folder)
    existing = os.path.dirname(missing[-1]) if missing else folder
    if not os.path.isdir(existing):
        return f"cannot create its folder {folder}: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write in {existing} (permission denied)"
    return None


def _missing_folders(folder: str) -> List[str]:
    """``folder`` and its ancestors that do not exist, innermost first."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def write_jsonl_atomic(path: str, rows: List[Dict[str, Any]]) -> None:
    """Write a temporary file, then rename: OUT is complete or absent. A missing folder is created (as
    ``mkdir -p``) and removed again if the write fails."""
    directory = os.path.dirname(os.path.abspath(path))
    created = _missing_folders(directory)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            os.unlink(tmp)
        for d in created:  # innermost first
            try:
                os.rmdir(d)
            except OSError:
                break
        if isinstance(e, OSError):  # name OUT, not the temporary file the user never gave
            raise ConvertError(f"{path}: cannot write it ({e.strerror or e})") from e
        raise


def build_parser(prog: str = "slime-hydra-convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert a dataset into slime_hydra's prompt JSONL.")
    p.add_argument("input", help="CSV, TSV, JSON, JSONL, parquet, or a datasets save_to_disk directory")
    p.add_argument("output", help="the JSONL to write")
    p.add_argument("--input-col", default="prompt", help="column with the prompt (text or chat messages)")
    p.add_argument("--label-col", default="label", help="column with the label")
    p.add_argument("--no-label", action="store_true", help="write rows without a label")
    p.add_argument("--metadata-cols", default="", help="comma-separated columns to keep under metadata")
    p.add_argument("--chat", action="store_true", help="write prompts as chat messages (one user turn)")
    p.add_argument("--system-prompt", default=None, help="a system message before the prompt (needs --chat)")
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict")
    p.add_argument("--format", default=None, choices=FORMATS, help="input format (default: from the extension)")
    p.add_argument("--limit", type=int, default=None, help="stop after writing N rows")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "slime-hydra-convert") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        summary = convert(args.input, args.output, input_col=args.input_col,
                          label_col=None if args.no_label else args.label_col,
                          metadata_cols=[c.strip() for c in args.metadata_cols.split(",") if c.strip()],
                          chat=args.chat, system_prompt=args.system_prompt, overwrite=args.overwrite,
                          limit=args.limit, split=args.split, fmt=args.format)
    except (ConvertError, DataError, OSError, UnicodeDecodeError) as e:  # no traceback for bad input
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (csv.Error, RecursionError) as e:
        print(f"error: {args.input}: {e}", file=sys.stderr)
        return 1
    print(summary.report(args.output))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
