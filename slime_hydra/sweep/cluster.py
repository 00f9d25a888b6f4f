"""The sweep's one Ray cluster (or ``cluster.address``), which every job joins (``SWEEP_CLUSTER_ENV``): Ray queues
their placement groups. A watchdog in its own session kills what a SIGKILLed sweep left (launch/lease.py's reap)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Optional

from slime_hydra.launch.lease import (
    LEASE_FILE,
    TOKEN_ENV,
    own_child,
    reap,
    start_watchdog,
    stop_watchdog,
    wait_for_exit,
)
from slime_hydra.logging.metrics import write_json_atomic
from slime_hydra.sweep.jobs import job_dirs

log = logging.getLogger(__name__)


def reap_sweep(sweep_dir: str, token: Optional[str], ray_session_dir: Optional[str]) -> int:
    """Kill every process of the sweep and of its jobs still running; returns how many."""
    killed = 0
    for job_dir in job_dirs(sweep_dir):  # a job writes its status file before it starts its driver
        try:
            with open(os.path.join(job_dir, LEASE_FILE)) as f:
                job = json.load(f)
        except (OSError, ValueError):
            continue
        killed += len(reap(job["token"], job.get("ray_session_dir")))
    if token:
        # but this process's joblib resource tracker: it ends with it (killed earlier, it warns of no leaks)
        killed += len(reap(token, ray_session_dir, spare=own_child(b"resource_tracker")))
    return killed


class SweepCluster:
    """``start()`` once before the first job, ``stop()`` after the last (also after an error)."""

    def __init__(self, sweep_dir: str, num_cpus: int, num_gpus: int, address: Optional[str] = None):
        self.sweep_dir, self.num_cpus, self.num_gpus, self.address = sweep_dir, num_cpus, num_gpus, address
        self.token: Optional[str] = None
        self.session_dir: Optional[str] = None
        self.watchdog: Optional[subprocess.Popen] = None
        self.started = False

    def start(self) -> str:
        """Start (or name) the cluster; the jobs' processes, started after this, join it."""
        import ray

        from slime_hydra.launch.cluster import LOCAL_HOST, SWEEP_CLUSTER_ENV

        if self.started:
            return os.environ[SWEEP_CLUSTER_ENV]
        os.makedirs(self.sweep_dir, exist_ok=True)
        if self.address:
            os.environ[SWEEP_CLUSTER_ENV] = self.address
            self.started = True
            return self.address
        self.token = uuid.uuid4().hex
        os.environ[TOKEN_ENV] = self.token  # inherited by Ray's processes and the launcher's job processes
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        t0 = time.perf_counter()
        ctx = ray.init(address="local", num_cpus=self.num_cpus, num_gpus=self.num_gpus, include_dashboard=False,
                       log_to_driver=False, logging_level=logging.WARNING, _node_ip_address=LOCAL_HOST)
        self.session_dir = ctx.address_info["session_dir"]
        address = ctx.address_info["gcs_address"]
        os.environ[SWEEP_CLUSTER_ENV] = address
        self._start_watchdog()
        self.started = True
        log.info("sweep: one Ray cluster for every job at %s (%s CPUs, %s GPUs), started in %.1fs", address,
                 self.num_cpus, "the machine's" if self.num_gpus is None else self.num_gpus, time.perf_counter() - t0)
        write_json_atomic(os.path.join(self.sweep_dir, "sweep_cluster.json"), {
            "address": address, "num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "pid": os.getpid(),
            "started": time.time()})
        return address

    def _start_watchdog(self) -> None:
        self.watchdog = start_watchdog("slime_hydra.sweep.cluster", self.sweep_dir, self.token, self.session_dir)

    def stop(self) -> None:
        import ray

        from slime_hydra.launch.cluster import SWEEP_CLUSTER_ENV

        if not self.started:
            return
        self.started = False
        os.environ.pop(SWEEP_CLUSTER_ENV, None)
        if self.address:
            return
        ray.shutdown()
        killed = reap_sweep(self.sweep_dir, self.token, self.session_dir)
        if killed:
            log.info("sweep: killed %d process(es) still running after the cluster's shutdown", killed)
        os.environ.pop(TOKEN_ENV, None)
        stop_watchdog(self.watchdog)


def watch(parent: int, parent_start: str, sweep_dir: str, token: str, session_dir: str) -> None:
    """The watchdog: when the sweep's process is gone (without ``stop``'s SIGTERM), kill what it left."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    wait_for_exit(parent, parent_start)
    reap_sweep(sweep_dir, token, session_dir)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
