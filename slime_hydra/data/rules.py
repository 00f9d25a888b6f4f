"""Config rules of the data (``data.*``), the tokenizer (``model.tokenizer``), the eval datasets and the
buffer hook. Dataset files are parsed with the rollout manager's own reader, so a bad row fails before Ray
starts; rendering the chat template is left to the manager (it needs the tokenizer).
"""

from __future__ import annotations

import os
from typing import List

from slime_hydra.config.rules import choice, data_file, loads, looks_local
from slime_hydra.config.schema import RunConfig
from slime_hydra.data.dataset import DataError
from slime_hydra.data.source import load_rows
from slime_hydra.data.tasks import BUILTIN_TOKENIZERS, TASK_TOKENIZERS, TASKS
from slime_hydra.utils.hooks import load_hook

SOURCES = ["builtin", "jsonl", "verifiers"]


def check(cfg: RunConfig) -> List[str]:
    errs = _check_tokenizer(cfg) + _check_source(cfg)
    if cfg.data.source in SOURCES:  # eval datasets without a path need to know the source
        errs += _check_eval(cfg)
    if cfg.data.buffer_filter is not None:  # it imports as the data source will load it
        loads(errs, "data.buffer_filter", lambda: load_hook(cfg.data.buffer_filter))
    return errs


def _check_tokenizer(cfg: RunConfig) -> List[str]:
    errs, m, tok = [], cfg.model, cfg.model.tokenizer
    if m.path is None and tok is None:
        errs.append("model.tokenizer: required when model.path is null (the model is built from model.arch)")
    if tok is not None and tok.startswith("builtin:"):
        if choice(errs, "model.tokenizer", tok, BUILTIN_TOKENIZERS):
            vocab = len(BUILTIN_TOKENIZERS[tok])
            if m.arch.vocab_size != vocab:
                errs.append(f"model.arch.vocab_size: {m.arch.vocab_size} != {vocab}, the size of the {tok} tokenizer")
    elif tok is not None and looks_local(tok) and not os.path.isdir(os.path.expanduser(tok)):
        errs.append(f"model.tokenizer: {tok!r} is not a directory")
    return errs


def _check_source(cfg: RunConfig) -> List[str]:
    errs, d = [], cfg.data
    if d.num_epoch is not None and d.num_epoch < 1:
        errs.append(f"data.num_epoch: must be >= 1, got {d.num_epoch}")
    if not choice(errs, "data.source", d.source, SOURCES):
        return errs
    if d.source == "builtin":
        if choice(errs, "data.task", d.task, TASKS):
            if cfg.model.tokenizer != TASK_TOKENIZERS[d.task]:
                errs.append(f"model.tokenizer: the built-in task {d.task} is written in the {TASK_TOKENIZERS[d.task]} "
                            f"vocabulary, but model.tokenizer={cfg.model.tokenizer!r} (train model={cfg.model.name} on "
                            "your data: data=jsonl data.path=...)")
            space = TASKS[d.task][0]  # what data.tasks.make_splits draws disjoint train and held-out prompts from
            if d.num_train < 1 or d.num_eval < 0:
                errs.append(f"data.num_train: must be >= 1 (and data.num_eval >= 0), got {d.num_train} and "
                            f"{d.num_eval}")
            elif d.num_train + d.num_eval > space:
                errs.append(f"data.num_train: data.num_train + data.num_eval = {d.num_train} + {d.num_eval} = "
                            f"{d.num_train + d.num_eval} must be <= {space}, the number of distinct {d.task} prompts "
                            "(held-out prompts are never training prompts)")
    elif d.source == "verifiers" and not d.path:  # the taskset's tasks
        _check_rendering(errs, d, loads(errs, "data.task", lambda: load_rows(d), explained=(ValueError,)))
    elif not d.path:
        errs.append("data.path: required for data.source=jsonl")
    elif not os.path.isfile(os.path.expanduser(data_file(d.path))):
        errs.append(f"data.path: {data_file(d.path)!r} does not exist (a .jsonl or .parquet file)")
    else:
        _check_rendering(errs, d, loads(errs, "data.path", lambda: load_rows(d), explained=(DataError,)))
    if d.system_prompt is not None and not d.apply_chat_template:
        errs.append("data.system_prompt: needs data.apply_chat_template=true (the chat template writes the system "
                    "message)")
    return errs


def _check_rendering(errs: List[str], d, rows) -> None:
    """What ``dataset.render_prompt`` would refuse once the run has started: chat prompts without the template."""
    chat = next((r for r in rows or () if not isinstance(r.prompt, str)), None)
    if chat is not None and not d.apply_chat_template:
        errs.append(f"data.apply_chat_template: {chat.source}: the prompt is a list of chat messages; set "
                    "data.apply_chat_template=true to render it")


def _check_eval(cfg: RunConfig) -> List[str]:
    errs, d = [], cfg.data
    for i, ds in enumerate(cfg.eval.datasets):
        where = f"eval.datasets[{i}]"
        if ds.path is None and d.source != "builtin":
            errs.append(f"{where}.path: required (only the built-in task has an implicit held-out split)")
        if ds.path is not None and not os.path.isfile(os.path.expanduser(data_file(ds.path))):
            errs.append(f"{where}.path: {data_file(ds.path)!r} does not exist")
        elif ds.path is not None:
            _check_rendering(errs, d, loads(errs, f"{where}.path", lambda ds=ds: load_rows(
                d, split="eval", path=ds.path, input_key=ds.input_key, label_key=ds.label_key), explained=(DataError,)))
        if ds.temperature < 0:
            errs.append(f"{where}.temperature: must be >= 0, got {ds.temperature}")
        if ds.n_samples_per_prompt < 1:
            errs.append(f"{where}.n_samples_per_prompt: must be >= 1, got {ds.n_samples_per_prompt}")
    names = [ds.name for ds in cfg.eval.datasets]
    if len(set(names)) != len(names):
        errs.append(f"eval.datasets: names must be unique, got {names}")
    return errs

