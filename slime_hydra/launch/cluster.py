"""Ray: start or join a cluster, make the one placement group, and create the trainer actors."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_hydra.config.schema import RunConfig
from slime_hydra.launch.lease import TOKEN_ENV
from slime_hydra.plan.resources import TRAINER_SHARE, ResourcePlan
from slime_hydra.utils.proc import HOST_ENV, tail

if TYPE_CHECKING:
    from slime_hydra.train.backend import WarmUpShape

log = logging.getLogger(__name__)
LOCAL_HOST = "127.0.0.1"
# set by a sweep for its jobs: the address of the one Ray cluster they join (placement groups queue there)
SWEEP_CLUSTER_ENV = "SLIME_HYDRA_SWEEP_CLUSTER"


@contextlib.contextmanager
def ray_cluster(cfg: RunConfig, plan: ResourcePlan) -> Iterator[Optional[str]]:
    """A local Ray cluster sized for the plan, every server on 127.0.0.1 (or ``cluster.address`` joined, servers
    on their node's address); always shut down. Yields the local cluster's session directory (None: joined)."""
    env = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **cfg.cluster.env_vars}
    if TOKEN_ENV in os.environ:  # marks the run's processes on every node (launch/lease.py)
        env[TOKEN_ENV] = os.environ[TOKEN_ENV]
    address = cfg.cluster.address or os.environ.get(SWEEP_CLUSTER_ENV)
    local = not address
    if local:
        env[HOST_ENV] = os.environ[HOST_ENV] = LOCAL_HOST
    if plan.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(cfg.parallelism.cpu_threads))
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False, logging_level=logging.WARNING)
        log.info("joined the Ray cluster at %s%s", address, "" if cfg.cluster.address else " (the sweep's)")
        session_dir = None
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster: no token file
        need = len(plan.bundles) + 2
        num_cpus = cfg.cluster.num_cpus or max(os.cpu_count() or 1, need)
        gpus = sum(b.get("GPU", 0) for b in plan.bundles) if plan.device == "cuda" else 0
        # address="local": a cluster of its own, never one that RAY_ADDRESS or an earlier `ray start` names
        ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=cfg.cluster.include_dashboard,
                       log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": env},
                       num_gpus=gpus, _node_ip_address=LOCAL_HOST)
        session_dir = ctx.address_info["session_dir"]
    try:
        yield session_dir
    finally:
        ray.shutdown()
        if local:
            os.environ.pop(HOST_ENV, None)


def create_placement_group(plan: ResourcePlan, timeout_s: Optional[float] = 600.0):
    """The run's placement group, once Ray can place it; a sweep's job waits for earlier jobs without a deadline."""
    pg = placement_group(plan.bundles, strategy="PACK")
    t0 = time.monotonic()
    queued = bool(os.environ.get(SWEEP_CLUSTER_ENV))
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=30)
        if ready:
            return pg
        avail = ray.available_resources()
        log.warning("waiting for %d bundles of %s (available: %s)%s", len(plan.bundles), plan.bundles[0], avail,
                    " behind the sweep's other jobs" if queued else "")
        if not queued and timeout_s is not None and time.monotonic() - t0 > timeout_s:
            remove_placement_group(pg)
            raise TimeoutError(f"the cluster cannot place {len(plan.bundles)} bundles of {plan.bundles[0]} "
                               f"(available: {avail}); check parallelism.* against the cluster")


def placed(plan: ResourcePlan, pg) -> ResourcePlan:
    """The plan on the bundles where Ray put them: the plan numbers bundles node by node, PACK keeps no order
    across nodes, so bundle ``b`` becomes the ``b``-th in the order (node by its first bundle, then index)."""
    from dataclasses import replace

    from ray.util import placement_group_table

    nodes = placement_group_table(pg)["bundles_to_node_id"]
    nodes = [nodes[i] for i in range(len(plan.bundles))]
    first: Dict[str, int] = {}
    for i, node in enumerate(nodes):
        first.setdefault(node, i)
    order = sorted(range(len(nodes)), key=lambda i: (first[nodes[i]], i))
    if order == list(range(len(nodes))):
        return plan
    return replace(plan, trainers=[replace(t, bundle=order[t.bundle]) for t in plan.trainers],
                   engines=[replace(e, bundles=[order[b] for b in e.bundles]) for e in plan.engines])


@dataclass
class RankLayout:
    """Where each trainer rank sits, as its backend reported it after start-up."""

    dp_ranks: List[int]  # per global rank: its data-parallel rank (which share of a rollout it trains on)
    pusher: int  # the global rank that sends the weights to the engines
    reporter: int  # the global rank whose training metrics the driver logs


def rank_layout(ranks: List[Dict[str, Any]], data_parallel: int) -> RankLayout:
    """The ranks' answers to ``TrainerActor.init`` checked: every data-parallel rank present, one pusher, a reporter."""
    dp_ranks = [r["dp_rank"] for r in ranks]
    sizes = {r["dp_size"] for r in ranks}
    if sizes != {data_parallel} or sorted(set(dp_ranks)) != list(range(data_parallel)):
        raise RuntimeError(f"trainer ranks report data-parallel ranks {dp_ranks} of sizes {sorted(sizes)}; "
                           f"the resource plan has data parallel {data_parallel}")
    pushers = [i for i, r in enumerate(ranks) if r["pushes_weights"]]
    if len(pushers) != 1:
        raise RuntimeError(f"exactly one trainer rank must push weights, got ranks {pushers}")
    reporters = [i for i, r in enumerate(ranks) if r["reports_metrics"]]
    if not reporters:
        raise RuntimeError("no trainer rank reports training metrics")
    return RankLayout(dp_ranks=dp_ranks, pusher=pushers[0], reporter=reporters[0])


def route(data_refs: List[Any], dp_ranks: List[int]) -> List[Any]:
    """Each global rank's share of a rollout (one share per data-parallel rank)."""
    if len(data_refs) != len(set(dp_ranks)):
        raise RuntimeError(f"the rollout has {len(data_refs)} data-parallel shares for "
                           f"{len(set(dp_ranks))} data-parallel ranks")
    return [data_refs[d] for d in dp_ranks]


class PartDied(RuntimeError):
    """A part of the run that the driver rebuilds died or hung: ``part`` is "trainer" or "manager"."""

    def __init__(self, part: str, reason: str, rank: Optional[int] = None):
        super().__init__(reason)
        self.part, self.reason, self.rank = part, reason, rank


def actor_log_tail(err: BaseException) -> str:
    """The last lines of a dead Ray actor's worker output (its ``.err`` log, by the pid Ray's error names)."""
    m = re.search(r"\bpid[:=] ?(\d+)", str(err))
    if not m:
        return "(Ray did not name its process)"
    try:
        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - no public way
        logs = os.path.join(session, "logs")
        for name in sorted(os.listdir(logs)):
            if name.startswith("worker-") and name.endswith(f"-{m[1]}.err"):
                return tail(os.path.join(logs, name), 20)
    except Exception as e:  # noqa: BLE001 - best effort, for an error message
        return f"(its log could not be read: {e!r})"
    return f"(no worker log of pid {m[1]} found)"


def wait_all(refs: List[Any], timeout_s: Optional[float], what: str) -> List[Any]:
    """``ray.get(refs)`` over the trainer ranks, but a rank that died (as soon as Ray knows) or is still busy after
    ``timeout_s`` raises :class:`PartDied`. Other errors are raised as they are."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                rank = refs.index(ref)
                raise PartDied("trainer", f"trainer rank {rank} died during {what} ({type(e).__name__}); "
                               f"last lines of its output:\n{actor_log_tail(e)}", rank) from e
            except Exception:  # noqa: BLE001 - a rank's own error: raised below, after the others answer
                pass
        if deadline is not None and time.monotonic() >= deadline and pending:
            ranks = [refs.index(r) for r in pending]
            raise PartDied("trainer", f"trainer rank(s) {ranks} did not finish {what} within "
                           f"trainer.hang_timeout_s={timeout_s:g}s (a hung collective?)", ranks[0])
    return ray.get(refs)


class TrainerGroup:
    """Driver-side handle on all trainer ranks; each call fans out and waits (``wait_all``; with fault tolerance
    ``trainer.hang_timeout_s``, a push ``sync.push_timeout_s``)."""

    def __init__(self, cfg: RunConfig, plan: ResourcePlan, pg, model_path: str):
        from slime_hydra.train.actor import TrainerActor

        cuda = plan.device == "cuda"
        share = {"num_gpus": TRAINER_SHARE, "num_cpus": 0} if cuda else {"num_cpus": TRAINER_SHARE}
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "NCCL_CUMEM_ENABLE": "0"} if cuda else {}
        world = len(plan.trainers)
        parts = dict(model=cfg.model, algo=cfg.algo, trainer=cfg.trainer, parallelism=cfg.parallelism, sync=cfg.sync,
                     seed=cfg.seed, run_dir=cfg.output_dir, teacher=cfg.teacher)
        actor = ray.remote(TrainerActor)
        self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, t.bundle),
                                     runtime_env={"env_vars": env}, **share).remote(t.rank, world, model_path, **parts)
                       for t in plan.trainers]
        self.connected: List[str] = []  # the engine URLs the weight push goes to
        ft = cfg.rollout.fault_tolerance
        self.timeout_s = cfg.trainer.hang_timeout_s if ft else None
        self.push_timeout_s = cfg.sync.push_timeout_s + 60.0 if ft else None  # the push's own deadlines come first
        try:
            master = self._wait([self.actors[0].master_address.remote()], "start-up")[0]
            self.layout = rank_layout(self._wait([a.init.remote(master) for a in self.actors], "start-up"),
                                      plan.data_parallel)
        except BaseException:
            self.kill()  # free their bundles: a group built again takes them
            raise

    def _wait(self, refs: List[Any], what: str, timeout_s: Optional[float] = None) -> List[Any]:
        return wait_all(refs, timeout_s or self.timeout_s, what)

    def _all(self, method: str, *args) -> List[Any]:
        return self._wait([getattr(a, method).remote(*args) for a in self.actors], method)

    def set_num_rollout(self, num_rollout: int) -> None:
        self._all("set_num_rollout", num_rollout)

    def connect(self, endpoints) -> None:
        self._all("connect", endpoints)
        self.connected = [e["url"] for e in endpoints]

    def reconnect(self, endpoints) -> None:
        """After an engine restarted: a new weight sender (a weight-update group has fixed members) to ``endpoints``."""
        self._all("shutdown")
        self.connect(endpoints)

    def train(self, data_refs: List[Any], temperature: float, max_response_len: int) -> Dict[str, float]:
        """One rollout's training on its data-parallel shares; the metrics of the reporting rank."""
        refs = route(data_refs, self.layout.dp_ranks)
        out = self._wait([a.train.remote(ref, temperature, max_response_len) for a, ref in zip(self.actors, refs)],
                         "a training step")
        return out[self.layout.reporter]

    def update_weights(self, version: int) -> Dict[str, float]:
        refs = [a.update_weights.remote(version) for a in self.actors]
        return self._wait(refs, "a weight push", self.push_timeout_s)[self.layout.pusher]

    def offload(self, keep_weights: bool = False) -> None:
        self._all("offload", keep_weights)

    def onload(self) -> None:
        self._all("onload")

    def free_cache(self) -> None:
        self._all("free_cache")

    def warm_up(self, temperature: float, shape: "WarmUpShape") -> None:
        self._all("warm_up", temperature, shape)

    def save(self, out_dir: str, tokenizer_dir: str) -> None:
        self._all("save", out_dir, tokenizer_dir)

    def load(self, ckpt_dir: str) -> None:
        self._all("load", ckpt_dir)

    def shutdown(self) -> None:
        self._all("shutdown")

    def kill(self) -> None:
        """Tear the group down at once (the others may be stuck in a collective with a dead rank)."""
        for a in self.actors:
            ray.kill(a)
