"""The data position saved with a checkpoint (slime_hydra/rollout/data_state.py): as it was when the
asked-for rollout started, when that rollout has started, else the current one."""

from __future__ import annotations

from rollout_harness import make_rollout
from slime_hydra.rollout.data_state import DataState


def test_state_at_the_start_of_a_rollout():
    source = make_rollout(["rollout.batch_size=2", "rollout.n_samples_per_prompt=2"]).source
    state = DataState(source)
    state.rollout_starts(3)
    source.get_samples(2)  # rollout 3 takes its prompts
    assert state.state_dict(3)["offset"] == 0  # an async run saving step 3 while rollout 3 runs
    assert state.state_dict(4)["offset"] == 2 == state.state_dict()["offset"]  # not started: now
    saved = state.state_dict(3)
    state.rollout_starts(4)
    source.get_samples(2)
    assert state.state_dict(3)["offset"] == 4  # only the latest rollout's start is kept
    state.load_state_dict(saved)
    assert source.offset == 0 and state.state_dict()["offset"] == 0
