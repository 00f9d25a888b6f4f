"""Config rules of the data (``data.*``), the tokenizer (``model.tokenizer``), the eval datasets and the
buffer hook. Dataset files are parsed with the rollout manager's own reader, so a bad row fails before Ray
starts. With an in-code tokenizer every row is also rendered and tokenized here, as the manager will; a
downloaded tokenizer's rendering is left to the manager.
"""

from __future__ import annotations

import logging
import os
from typing import List

from slime_hydra.config.rules import choice, data_file, loads, looks_local
from slime_hydra.config.schema import RunConfig
from slime_hydra.data.dataset import DataError, Row
from slime_hydra.data.source import load_rows
from slime_hydra.data.tasks import BUILTIN_TOKENIZERS, TASK_TOKENIZERS, TASKS
from slime_hydra.utils.hooks import load_hook

log = logging.getLogger(__name__)
SOURCES = ["builtin", "jsonl", "verifiers"]
# what to set when a built-in character tokenizer cannot write the data
ANY_TEXT = ("to train the tiny model on any text set model.tokenizer=builtin:bytes model.arch.vocab_size=262 (what "
            "model=tiny data=jsonl picks), or use a model with its own tokenizer (e.g. model=qwen3_0_6b)")


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
                errs.append(f"model.arch.vocab_size: {m.arch.vocab_size} != {vocab}, the size of the {tok} tokenizer "
                            f"(set model.arch.vocab_size={vocab})")
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
        rows = loads(errs, "data.path", lambda: load_rows(d), explained=(DataError,))
        if rows and not _check_rendering(errs, d, rows):
            _check_builtin_tokenizer(errs, cfg, "data.path", rows, cfg.rollout.max_response_len)
            _check_size(errs, cfg, len(rows))
    if d.system_prompt is not None and not d.apply_chat_template:
        errs.append("data.system_prompt: needs data.apply_chat_template=true (the chat template writes the system "
                    "message)")
    return errs


def _check_rendering(errs: List[str], d, rows) -> bool:
    """What ``dataset.render_prompt`` would refuse once the run has started: chat prompts without the template.
    True when it refused."""
    chat = next((r for r in rows or () if not isinstance(r.prompt, str)), None)
    if chat is not None and not d.apply_chat_template:
        errs.append(f"data.apply_chat_template: {chat.source}: the prompt is a list of chat messages; set "
                    "data.apply_chat_template=true to render it")
        return True
    return False


def _check_builtin_tokenizer(errs: List[str], cfg: RunConfig, where: str, rows: List[Row], response_len: int) -> None:
    """With an in-code tokenizer, the rows are rendered here as the rollout manager will: a character its vocabulary
    cannot write (in a prompt or a label) and a prompt too long for the model's positions are refused now."""
    name, r, pos = cfg.model.tokenizer, cfg.rollout, cfg.model.arch.max_position_embeddings
    if name not in BUILTIN_TOKENIZERS:
        return
    from slime_hydra.data.source import render_prompts
    from slime_hydra.data.tokenizer import builtin_tokenizer, unknown_chars

    tok = builtin_tokenizer(name)
    prompts = loads(errs, where, lambda: render_prompts(rows, tok, cfg.data), explained=(DataError,))
    if prompts is None:
        return
    bad = [(row.source, chars) for row, p in zip(rows, prompts)
           if (chars := unknown_chars(name, p + ("" if row.label is None else str(row.label))))]
    if bad:
        shown = "; ".join(f"{src}: {' '.join(map(repr, chars[:10]))}" for src, chars in bad[:3])
        more = f" (and {len(bad) - 3} more rows)" if len(bad) > 3 else ""
        errs.append(f"model.tokenizer: {name} has no token for these characters of {where} (prompt as rendered, or "
                    f"label): {shown}{more}; {ANY_TEXT}")
        return
    lengths = [len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"]]
    kept = [(n, row.source) for n, row in zip(lengths, rows) if r.max_prompt_len is None or n <= r.max_prompt_len]
    if not kept:
        errs.append(f"rollout.max_prompt_len: every prompt of {where} is longer than {r.max_prompt_len} tokens (the "
                    f"shortest has {min(lengths)}); set rollout.max_prompt_len={max(lengths)} to keep them all")
        return
    longest, source = max(kept)
    if longest + response_len > pos:
        fits = any(n + response_len <= pos for n, _ in kept)
        fixes = [f"rollout.max_prompt_len={pos - response_len} to drop longer prompts"] if fits else []
        if cfg.model.path is None:  # the model is built from model.arch
            fixes.insert(0, f"model.arch.max_position_embeddings={-(-(longest + response_len) // 64) * 64}")
        errs.append(f"model.arch.max_position_embeddings: {pos} positions cannot hold the longest prompt of {where} "
                    f"({source}: {longest} tokens) and a response of up to {response_len} tokens; set "
                    + (" or ".join(fixes) or "a shorter rollout.max_response_len"))


def _check_size(errs: List[str], cfg: RunConfig, n: int) -> None:
    """A dataset smaller than one rollout batch: refused where data.num_epoch counts the rollouts (it would make
    none), said otherwise, with what happens."""
    b, k = cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt
    if n >= b:
        return
    if cfg.trainer.num_rollout is None and cfg.data.num_epoch is not None:
        errs.append(f"data.num_epoch: data.path has {n} prompts, fewer than rollout.batch_size={b}, so an epoch is "
                    f"no whole rollout and the run would train 0 steps; set rollout.batch_size={n}, or "
                    "trainer.num_rollout=N data.num_epoch=null")
        return
    log.warning("data.path has %d prompts, fewer than rollout.batch_size=%d: every rollout walks the data %.3g times "
                "(%d samples of each prompt per pass; data/epoch counts the passes); rollout.batch_size=%d makes a "
                "rollout one pass", n, b, b / n, k, n)


def _check_eval(cfg: RunConfig) -> List[str]:
    errs, d = [], cfg.data
    for i, ds in enumerate(cfg.eval.datasets):
        where = f"eval.datasets[{i}]"
        if ds.path is None and d.source != "builtin":
            errs.append(f"{where}.path: required (only the built-in task has an implicit held-out split)")
        if ds.path is not None and not os.path.isfile(os.path.expanduser(data_file(ds.path))):
            errs.append(f"{where}.path: {data_file(ds.path)!r} does not exist")
        elif ds.path is not None:
            rows = loads(errs, f"{where}.path", lambda ds=ds: load_rows(
                d, split="eval", path=ds.path, input_key=ds.input_key, label_key=ds.label_key), explained=(DataError,))
            if rows and not _check_rendering(errs, d, rows):
                _check_builtin_tokenizer(errs, cfg, f"{where}.path", rows[:ds.max_prompts],
                                         ds.max_response_len or cfg.rollout.max_response_len)
        if ds.temperature < 0:
            errs.append(f"{where}.temperature: must be >= 0, got {ds.temperature}")
        if ds.n_samples_per_prompt < 1:
            errs.append(f"{where}.n_samples_per_prompt: must be >= 1, got {ds.n_samples_per_prompt}")
    if not cfg.eval.datasets:
        log.info("eval.datasets is empty: no held-out reward, the run reports its training reward (a held-out set: "
                 "eval.datasets='[{name: heldout, path: \"data.jsonl@[0:64]\"}]')")
    names = [ds.name for ds in cfg.eval.datasets]
    if len(set(names)) != len(names):
        errs.append(f"eval.datasets: names must be unique, got {names}")
    return errs

