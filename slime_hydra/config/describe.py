"""Every config key with its type, its value and a one-line description, for the command line:

    python -m slime_hydra.config describe                      # every key
    python -m slime_hydra.config describe rollout algo.lr      # the keys under these prefixes
    python -m slime_hydra.config describe rollout model=qwen3_4b rollout=sglang   # values under overrides

Descriptions are schema.py's field comments; values are the composed config's, before derived values are filled.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import sys
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

from slime_hydra.config import schema

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass
class Key:
    """One config key: ``eval.datasets[].name`` stands for the field of every list item."""

    path: str
    type: str
    default: Any  # the schema's default (MISSING: required)
    description: str
    owner: type  # the dataclass that declares it


@functools.cache
def field_comments(source_file: str) -> Dict[str, Dict[str, str]]:
    """``{class: {field: description}}`` of a module's dataclasses: a trailing comment, else the comments above."""
    text = Path(source_file).read_text()
    comments: Dict[int, str] = {}  # line -> comment text
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    out: Dict[str, Dict[str, str]] = {}
    for cls in ast.walk(ast.parse(text)):
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = out.setdefault(cls.name, {})
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            lines = range(node.lineno, node.end_lineno + 1)
            trailing = [comments[n] for n in lines if n in comments and n in code_lines]
            above, line = [], node.lineno - 1
            while line in comments and line not in code_lines:  # a comment-only line right above
                above.insert(0, comments[line])
                line -= 1
            fields[node.target.id] = " ".join(trailing) or " ".join(above)
    return out


def type_name(tp: Any) -> str:
    """``Optional[int]`` -> ``int | None``, ``Dict[str, Any]`` -> ``dict``, ``List[str]`` -> ``list[str]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return " | ".join(type_name(a) for a in args)
    if origin in (list, List):
        return f"list[{type_name(args[0])}]" if args and args[0] is not Any else "list"
    if origin in (dict, Dict):
        return "dict"
    if tp is Any:
        return "any"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def schema_keys(cls: type = schema.RunConfig, prefix: str = "") -> List[Key]:
    """Every key of ``cls`` and of the dataclasses under it, depth first, in declaration order."""
    docs = field_comments(inspect.getsourcefile(cls)).get(cls.__name__, {})
    hints = typing.get_type_hints(cls)
    keys: List[Key] = []
    for f in dataclasses.fields(cls):
        path, tp = prefix + f.name, hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) in (list, List) and typing.get_args(tp) else None
        nested = tp if dataclasses.is_dataclass(tp) else None
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING
        if nested is not None:
            keys.append(Key(path, "group", None, docs.get(f.name, ""), cls))
            keys += schema_keys(nested, path + ".")
        elif item is not None and dataclasses.is_dataclass(item):
            keys.append(Key(path, f"list[{item.__name__}]", default, docs.get(f.name, ""), cls))
            keys += schema_keys(item, path + "[].")
        else:
            keys.append(Key(path, type_name(tp), default, docs.get(f.name, ""), cls))
    return keys


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``python run.py <overrides>`` composes (not resolved, not validated)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from slime_hydra.config.store import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def value_of(cfg: Optional[DictConfig], key: Key) -> str:
    """The key's value in ``cfg`` as YAML shows it (the schema's default without ``cfg`` and for list items)."""
    value = key.default
    if cfg is not None and "[]" not in key.path:
        try:
            value = OmegaConf.select(cfg, key.path, throw_on_missing=True)
        except MissingMandatoryValue:
            return "???"
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    if value is MISSING:
        return "???"
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        value = [v["name"] for v in value]  # eval.datasets: their names (describe eval.datasets[] for the fields)
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def select(keys: List[Key], prefixes: Sequence[str]) -> List[Key]:
    """The keys at or under ``prefixes`` (all without any); an unknown prefix is a ValueError naming close ones."""
    if not prefixes:
        return keys
    out = []
    for p in prefixes:
        p = p.rstrip(".")
        hits = [k for k in keys if k.path == p or k.path.startswith(p + ".") or k.path.startswith(p + "[]")]
        if not hits:
            close = difflib.get_close_matches(p, [k.path for k in keys], n=3, cutoff=0.5)
            raise ValueError(f"no config key {p!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
        out += [k for k in hits if k not in out]
    return out


def describe(prefixes: Sequence[str] = (), overrides: Sequence[str] = ()) -> str:
    """``key  type = value  # description`` per key, a heading line per group."""
    keys = select(schema_keys(), prefixes)
    cfg = compose(overrides)
    rows = [(k.path, k.type if k.type == "group" else f"{k.type} = {value_of(cfg, k)}", k.description) for k in keys]
    width = max(len(p) for p, _, _ in rows)
    type_width = min(40, max(len(t) for _, t, _ in rows))
    lines = [(f"\n{path}:  # {doc}" if doc else f"\n{path}:") if typed == "group" else
             f"{path:<{width}}  {typed:<{type_width}}  # {doc}" for path, typed, doc in rows]
    return "\n".join(lines).lstrip("\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.split("\n\n")[0] + "\n" + __doc__.split("\n\n")[1])
        return 0
    overrides = [a for a in argv if "=" in a]
    prefixes = [a for a in argv if "=" not in a]
    from hydra.errors import HydraException

    try:
        print(describe(prefixes, overrides))
    except (ValueError, HydraException) as e:  # an unknown key, or an override Hydra refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
