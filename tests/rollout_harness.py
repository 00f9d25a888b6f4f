"""The rollout manager's parts without Ray or engine actors, for tests of the rollout function, the
dynamic filter, hooks and evaluation: the real rollout context (tokenizer, data source with its
buffer filter, generate function, dynamic filter) and evaluator, built from composed overrides as
the manager builds them, with requests going to ``client`` and aborts to ``fleet``'s engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from conftest import resolved
from slime_hydra.data.tokenizer import load_tokenizer
from slime_hydra.rollout.evaluate import Evaluator, load_eval_sets
from slime_hydra.rollout.fleet import EngineFleet
from slime_hydra.rollout.health import EngineHandle
from slime_hydra.rollout.rollout_fn import RolloutContext, build_rollout_context, default_rollout


@dataclass
class Rollout:
    ctx: RolloutContext
    evaluator: Evaluator
    fleet: EngineFleet

    @property
    def cfg(self):
        return self.ctx.cfg

    @property
    def source(self):
        return self.ctx.source

    def set_generate(self, fn) -> None:
        self.ctx.sampler.generate_fn = fn

    async def collect(self, rollout_id: int = 0, weight_version: Optional[str] = None):
        """One rollout of the default rollout function, watched like the manager's."""
        return await self.fleet.watched(default_rollout(self.ctx, rollout_id, weight_version))

    def run(self, rollout_id: int = 0, weight_version: Optional[str] = None):
        return asyncio.run(self.collect(rollout_id, weight_version))

    def eval(self):
        return asyncio.run(self.evaluator.run())


def make_rollout(overrides: Sequence[str] = (), *, client: Any = None, urls: Sequence[str] = (),
                 fleet: Optional[EngineFleet] = None) -> Rollout:
    """The parts for ``overrides``; ``urls``: engines started elsewhere (aborts go to them)."""
    cfg = resolved(list(overrides))
    fleet = fleet or EngineFleet([EngineHandle(rank, url) for rank, url in enumerate(urls)])
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)  # builtin: no checkpoint
    ctx = build_rollout_context(cfg, tokenizer, client, fleet.abort)
    sets = load_eval_sets(cfg.eval.datasets, cfg.data, tokenizer, cfg.rollout.max_prompt_len)
    evaluator = Evaluator(sets, ctx.sampler, cfg.rollout, cfg.reward.key, cfg.logging.log_samples)
    return Rollout(ctx, evaluator, fleet)
