"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``: raylets with their own CPU slots
and a custom resource naming each node): the placement group, the trainers, the engines and the
weight-update group span nodes as the resource plan says, for split and colocated layouts; an engine
spanning two nodes gets one command line per node (node rank, the address of node 0)."""

from __future__ import annotations

import logging
import os

import httpx
import pytest
import ray

from conftest import resolved
from slime_hydra.config.schema import RouterConfig
from slime_hydra.launch.cluster import TrainerGroup, create_placement_group, placed
from slime_hydra.model.hf import initial_checkpoint
from slime_hydra.plan.resources import make_plan
from slime_hydra.rollout.engines.actor import join_nodes
from slime_hydra.rollout.fleet import EngineFleet, engine_specs
from slime_hydra.utils.http import weight_version

pytestmark = pytest.mark.integration
NODES = ("node_a", "node_b")


@pytest.fixture(scope="module")
def cluster():
    """A head node without slots (the driver) and two nodes of one CPU slot each."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for name in NODES:
        c.add_node(num_cpus=1, resources={name: 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def node_names() -> dict:
    return {n["NodeID"]: next((r for r in n["Resources"] if r in NODES), "head") for n in ray.nodes() if n["Alive"]}


def node_of(actor) -> str:
    return node_names()[ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))]


def setup(cluster, tmp_path, overrides):
    cfg = resolved(["parallelism.gpus_per_node=1", "parallelism.num_nodes=2", f"cluster.address={cluster.address}",
                    *overrides])
    cfg.output_dir = str(tmp_path)
    plan = make_plan(cfg)
    pg = create_placement_group(plan, timeout_s=120)
    return cfg, placed(plan, pg), pg


def run_layout(cfg, plan, pg, tmp_path):
    """Trainers and engines on their bundles, a weight push from trainer to engines, one generation."""
    model_path = initial_checkpoint(cfg.model, str(tmp_path))
    trainers = TrainerGroup(cfg, plan, pg, model_path)
    (tmp_path / "logs").mkdir()
    fleet = EngineFleet.start(engine_specs(cfg, plan, model_path), plan, pg, str(tmp_path / "logs"), 300,
                              RouterConfig(enabled=False))
    try:
        trainers.connect(fleet.endpoints())
        trainers.update_weights(1)
        assert [weight_version(u) for u in fleet.urls] == ["1"] * len(fleet.urls)
        out = httpx.post(fleet.urls[-1] + "/generate", json={"input_ids": [3, 4], "sampling_params": {
            "max_new_tokens": 2, "temperature": 0.0}}, timeout=120).json()
        assert len(out["output_ids"]) == 2
        return [node_of(a) for a in trainers.actors], [node_of(e.actors[0]) for e in fleet.engines]
    finally:
        fleet.shutdown()
        trainers.shutdown()
        ray.util.remove_placement_group(pg)


def test_split_trainer_on_one_node_engine_on_the_other(cluster, tmp_path):
    cfg, plan, pg = setup(cluster, tmp_path, ["sync.transport=distributed"])
    trainer_nodes, engine_nodes = run_layout(cfg, plan, pg, tmp_path)
    assert len(trainer_nodes) == len(engine_nodes) == 1
    assert {trainer_nodes[0], engine_nodes[0]} == set(NODES)  # the gloo weight-update group spans both


@pytest.mark.slow
def test_colocated_trainer_group_spans_nodes(cluster, tmp_path):
    cfg, plan, pg = setup(cluster, tmp_path, ["parallelism=cpu_colocate", "parallelism.trainer_gpus=2",
                                              "parallelism.rollout_gpus=2"])
    trainer_nodes, engine_nodes = run_layout(cfg, plan, pg, tmp_path)
    assert sorted(trainer_nodes) == list(NODES)  # the trainers' gloo group spans both nodes
    assert engine_nodes == trainer_nodes  # each engine beside its trainer


def test_engine_spanning_two_nodes_gets_a_command_line_per_node(cluster, tmp_path):
    """SGLang with tensor parallel 2 over nodes of one GPU each: an engine actor per node, as the fleet
    places them (CPU slots stand in for the GPUs: the command lines are built, not run)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from slime_hydra.rollout.engines.actor import EngineActor

    cfg = resolved(["rollout=sglang", "parallelism.device=cuda", "parallelism.gpus_per_node=1",
                    "parallelism.num_nodes=3", "parallelism.rollout_gpus=2", "parallelism.gpus_per_engine=2",
                    "model.path=/models/any"])
    (specs,) = engine_specs(cfg, make_plan(cfg), "/models/any")
    pg = placement_group([{"CPU": 1.0}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    actors = [ray.remote(EngineActor).options(num_cpus=0.2, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote(spec, 0, str(tmp_path), 60)
        for i, spec in enumerate(specs)]
    try:
        join_nodes(actors)  # as EngineFleet.start does
        cmds = ray.get([a.command.remote(port=30000) for a in actors])
        assert sorted(node_of(a) for a in actors) == list(NODES)
    finally:
        remove_placement_group(pg)

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert [flag(c, "--node-rank") for c in cmds] == ["0", "1"]
    assert {flag(c, "--nnodes") for c in cmds} == {"2"} and {flag(c, "--tp-size") for c in cmds} == {"2"}
    addr = flag(cmds[0], "--dist-init-addr")
    assert flag(cmds[1], "--dist-init-addr") == addr and addr.startswith(flag(cmds[0], "--host") + ":")


def test_cluster_address_auto_joins_the_running_cluster(cluster, monkeypatch):
    """``cluster.address=auto`` (as after ``ray start --head``; here RAY_ADDRESS names the cluster)."""
    from slime_hydra.launch.cluster import ray_cluster
    from slime_hydra.utils.proc import HOST_ENV, node_ip

    cfg = resolved(["cluster.address=auto"])
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ray.shutdown()
    with ray_cluster(cfg, make_plan(cfg)):
        assert set(node_names().values()) == {"head", *NODES}
        assert HOST_ENV not in os.environ and node_ip() == ray.util.get_node_ip_address()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)


def test_without_cluster_address_a_run_starts_a_cluster_of_its_own(cluster, monkeypatch):
    """Another cluster on the machine (here RAY_ADDRESS names it; also after `ray start` or beside another
    run) is not joined: Ray would refuse the run's own sizing ("When connecting to an existing cluster,
    num_cpus and num_gpus must not be provided", seen with two runs on one machine)."""
    from slime_hydra.launch.cluster import ray_cluster

    cfg = resolved([])
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    ray.shutdown()
    with ray_cluster(cfg, make_plan(cfg)) as session_dir:
        assert session_dir and set(node_names().values()) == {"head"} and len(ray.nodes()) == 1
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
