"""Which trainer rank trains on which share of a rollout, pushes the weights and reports metrics
(slime_hydra/launch/cluster.py), from what the ranks' backends report; no Ray needed."""

from __future__ import annotations

import pytest

from slime_hydra.launch.cluster import rank_layout, route


def ranks(dp_ranks, pusher=0, reporters=None):
    dp = len(set(dp_ranks))
    reporters = range(len(dp_ranks)) if reporters is None else reporters
    return [{"dp_rank": d, "dp_size": dp, "pushes_weights": i == pusher, "reports_metrics": i in reporters}
            for i, d in enumerate(dp_ranks)]


def megatron_dp_ranks(world: int, tp: int, pp: int) -> list:
    """Megatron's default rank order (tensor parallel fastest, then data, then pipeline)."""
    dp = world // (tp * pp)
    return [(r // tp) % dp for r in range(world)]


def test_data_parallel_only_each_rank_its_share():
    layout = rank_layout(ranks([0, 1, 2, 3]), data_parallel=4)
    assert route(["a", "b", "c", "d"], layout.dp_ranks) == ["a", "b", "c", "d"]
    assert (layout.pusher, layout.reporter) == (0, 0)


def test_tensor_parallel_ranks_share_rows():
    dp_ranks = megatron_dp_ranks(4, tp=2, pp=1)
    assert dp_ranks == [0, 0, 1, 1]
    layout = rank_layout(ranks(dp_ranks), data_parallel=2)
    assert route(["a", "b"], layout.dp_ranks) == ["a", "a", "b", "b"]


def test_tensor_and_pipeline_parallel_ranks_share_rows_and_the_last_stage_reports():
    dp_ranks = megatron_dp_ranks(8, tp=2, pp=2)  # ranks 0-3: first stage, 4-7: last stage
    layout = rank_layout(ranks(dp_ranks, reporters={4, 5, 6, 7}), data_parallel=2)
    assert route(["a", "b"], layout.dp_ranks) == ["a", "a", "b", "b"] * 2
    assert (layout.pusher, layout.reporter) == (0, 4)


def test_mismatches_are_errors():
    with pytest.raises(RuntimeError, match="the resource plan has data parallel 4"):
        rank_layout(ranks([0, 0, 1, 1]), data_parallel=4)
    with pytest.raises(RuntimeError, match=r"exactly one trainer rank must push weights, got ranks \[\]"):
        rank_layout(ranks([0, 1], pusher=None), data_parallel=2)
    with pytest.raises(RuntimeError, match="no trainer rank reports"):
        rank_layout(ranks([0, 1], reporters=()), data_parallel=2)
    with pytest.raises(RuntimeError, match="3 data-parallel shares for 2 data-parallel ranks"):
        route(["a", "b", "c"], [0, 0, 1, 1])
