"""The rollout manager's prompt source: a dataset walked in seeded per-epoch order, plus a buffer.

``get_samples(n)`` hands out ``n`` groups (``n_samples_per_prompt`` samples of one prompt): first groups
pushed back with ``add_samples``, picked by ``buffer_filter(buffer, n)`` (FIFO by default), then new prompts.
Epoch ``e``'s order is seeded with ``seed + e``, so a restart from ``state_dict()`` continues exactly.
"""

from __future__ import annotations

import copy
import logging
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

from slime_hydra.data.dataset import Row, filter_long_prompts, read_rows, render_prompt, rows_from_dicts
from slime_hydra.data.sample import Sample

log = logging.getLogger(__name__)

Group = List[Sample]
BufferFilter = Callable[[List[Group], int], List[Group]]


def pop_first(buffer: List[Group], n: int) -> List[Group]:
    """The default buffer filter: the ``n`` oldest groups, removed from the buffer."""
    taken = buffer[:n]
    del buffer[:n]
    return taken


class DataSource:
    def __init__(self, rows: List[Row], prompts: List[str], n_samples_per_prompt: int, *, shuffle: bool, seed: int,
                 buffer_filter: Optional[BufferFilter] = None):
        if len(rows) != len(prompts):
            raise ValueError(f"DataSource: {len(rows)} rows but {len(prompts)} prompts")
        if not rows:
            raise ValueError("DataSource: the dataset is empty (were all prompts filtered out as too long?)")
        if n_samples_per_prompt < 1:
            raise ValueError(f"DataSource: n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.rows, self.prompts, self.n_samples_per_prompt = rows, prompts, n_samples_per_prompt
        self.shuffle, self.seed = shuffle, seed
        self.buffer_filter = buffer_filter or pop_first
        self.buffer: List[Group] = []
        self.epoch, self.offset = 0, 0  # offset: prompts of the current epoch already handed out
        self.next_group_index, self.next_index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.prompts)

    def _permutation(self, epoch: int) -> List[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_samples(self, n_prompts: int) -> List[Group]:
        """``n_prompts`` groups: buffered ones first, then new prompts (wrapping into the next epoch)."""
        groups = self._from_buffer(n_prompts) if self.buffer else []
        while len(groups) < n_prompts:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            groups.append(self._new_group(self._order[self.offset]))
            self.offset += 1
        return groups

    def _from_buffer(self, n: int) -> List[Group]:
        before = len(self.buffer)
        groups = self.buffer_filter(self.buffer, n)
        if not isinstance(groups, list):
            raise TypeError("buffer_filter must return a list of groups (lists of Sample), "
                            f"got {type(groups).__name__}")
        if len(groups) > n:
            raise ValueError(f"buffer_filter returned {len(groups)} groups, more than the {n} asked for")
        if len(self.buffer) + len(groups) != before:
            raise ValueError("buffer_filter must remove the groups it returns from the buffer "
                             f"(buffer had {before}, returned {len(groups)}, {len(self.buffer)} left)")
        return groups

    def _new_group(self, i: int) -> Group:
        row = self.rows[i]
        metadata = dict(row.metadata, source=row.source)
        if row.tools is not None:
            metadata["tools"] = row.tools
        template = Sample(prompt=self.prompts[i], label=row.label, metadata=metadata, group_index=self.next_group_index)
        group = [copy.deepcopy(template) for _ in range(self.n_samples_per_prompt)]
        for s in group:
            s.index, self.next_index = self.next_index, self.next_index + 1
        self.next_group_index += 1
        return group

    def add_samples(self, groups: List[Group]) -> None:
        """Push groups back (served first by the next ``get_samples``)."""
        for k, g in enumerate(groups):
            if not isinstance(g, list) or not all(isinstance(s, Sample) for s in g):
                raise ValueError(f"add_samples: group {k} must be a list of Sample")
            if len(g) != self.n_samples_per_prompt:
                raise ValueError(f"add_samples: group {k} has {len(g)} samples, "
                                 f"expected n_samples_per_prompt={self.n_samples_per_prompt}")
        self.buffer.extend(groups)

    def state_dict(self) -> Dict[str, Any]:
        """JSON-serialisable position and buffer."""
        return {"epoch": self.epoch, "offset": self.offset, "next_group_index": self.next_group_index,
                "next_index": self.next_index, "buffer": [[s.to_dict() for s in g] for g in self.buffer],
                # to check that a restart reads the same dataset in the same order
                "num_prompts": len(self.prompts), "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        same = {"num_prompts": len(self.prompts), "shuffle": self.shuffle, "seed": self.seed}
        diff = {k: (d[k], v) for k, v in same.items() if k in d and d[k] != v}
        if diff:
            raise ValueError("DataSource.load_state_dict: the saved state is for another dataset order: "
                             + ", ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in diff.items()))
        if not 0 <= d["offset"] <= len(self.prompts):
            raise ValueError(f"DataSource.load_state_dict: offset {d['offset']} out of range")
        self.epoch, self.offset = int(d["epoch"]), int(d["offset"])
        self.next_group_index, self.next_index = int(d["next_group_index"]), int(d["next_index"])
        self.buffer = [[Sample.from_dict(s) for s in g] for g in d.get("buffer", [])]
        self._order = self._permutation(self.epoch)


def load_rows(cfg: Any, *, split: str = "train", path: Optional[str] = None, input_key: Optional[str] = None,
              label_key: Optional[str] = None) -> List[Row]:
    """The rows of a ``DataConfig``: the built-in task's ``split`` ("train" | "eval"), or a file.
    ``path``, ``input_key``, ``label_key`` (None: the config's) are for eval datasets."""
    keys = dict(input_key=input_key or cfg.input_key, label_key=label_key or cfg.label_key,
                metadata_key=cfg.metadata_key, tools_key=cfg.tools_key)
    if path is None and cfg.source == "builtin":
        from slime_hydra.data.tasks import make_splits

        train, held_out = make_splits(cfg.task, cfg.num_train, cfg.num_eval, cfg.seed)
        records = train if split == "train" else held_out
        keys.update(input_key="prompt", label_key="label")
        return rows_from_dicts(records, f"builtin:{cfg.task}:{split}", **keys)
    path = path or cfg.path
    if path is None and cfg.source == "verifiers":
        from slime_hydra.data.tasksets import rows

        keys.update(input_key="prompt", label_key=None, metadata_key="metadata")
        return rows_from_dicts(rows(cfg.task), f"verifiers:{cfg.task}", **keys)
    if path is None:
        raise ValueError("data.path: required for data.source=jsonl")
    return read_rows(path, **keys)


def render_prompts(rows: List[Row], tokenizer: Any, cfg: Any) -> List[str]:
    """Every row's prompt as the engine gets it (``cfg``: a DataConfig)."""
    from omegaconf import OmegaConf

    kwargs = cfg.chat_template_kwargs  # plain dicts for jinja
    kwargs = OmegaConf.to_container(kwargs, resolve=True) if OmegaConf.is_config(kwargs) else dict(kwargs or {})
    return [render_prompt(r, tokenizer, apply_chat_template=cfg.apply_chat_template, chat_template_kwargs=kwargs,
                          system_prompt=cfg.system_prompt) for r in rows]


def prepare_prompts(rows: List[Row], tokenizer: Any, cfg: Any, max_prompt_len: Optional[int] = None, *,
                    what: str = "data") -> Tuple[List[Row], List[str]]:
    """Render every row (``cfg``: a DataConfig) and drop the prompts over ``max_prompt_len`` tokens."""
    prompts = render_prompts(rows, tokenizer, cfg)
    kept, dropped = filter_long_prompts(prompts, tokenizer, max_prompt_len)
    if dropped:
        log.warning("%s: dropped %d of %d prompts longer than %d tokens", what, dropped, len(prompts), max_prompt_len)
    return [rows[i] for i in kept], [prompts[i] for i in kept]


def build_data_source(cfg: Any, tokenizer: Any, *, n_samples_per_prompt: int, max_prompt_len: Optional[int] = None,
                      buffer_filter: Optional[BufferFilter] = None) -> DataSource:
    """``DataConfig`` -> the training ``DataSource``."""
    rows, prompts = prepare_prompts(load_rows(cfg), tokenizer, cfg, max_prompt_len, what=f"data {cfg.name}")
    return DataSource(rows, prompts, n_samples_per_prompt, shuffle=cfg.shuffle, seed=cfg.seed,
                      buffer_filter=buffer_filter)


def load_eval_dataset(ecfg: Any, dcfg: Any, tokenizer: Any,
                      max_prompt_len: Optional[int] = None) -> Tuple[List[Row], List[str]]:
    """An ``EvalDatasetConfig`` -> (rows, prompts), in file order, at most ``max_prompts``; ``ecfg.reward`` is
    each row's ``metadata["rm_type"]`` unless the row sets its own."""
    rows = load_rows(dcfg, split="eval", path=ecfg.path, input_key=ecfg.input_key, label_key=ecfg.label_key)
    if ecfg.max_prompts is not None:
        rows = rows[: ecfg.max_prompts]
    if ecfg.reward is not None:
        for r in rows:
            r.metadata.setdefault("rm_type", ecfg.reward)
    return prepare_prompts(rows, tokenizer, dcfg, max_prompt_len, what=f"eval {ecfg.name}")
