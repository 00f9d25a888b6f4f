"""A rollout engine as a Ray actor: it holds the engine's GPUs in the placement group and owns the server
process, which dies with it; the engine's kind gives the command line and environment. An engine that spans
several nodes has one actor per node; node 0 serves HTTP, the others join it through ``dist_init_addr``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional

from slime_hydra.logging.secrets import redact_argv
from slime_hydra.rollout.engines import ServerSpec, make_engine
from slime_hydra.utils.proc import free_port, kill_tree, node_ip, spawn, tail, wait_http

log = logging.getLogger(__name__)


def engine_log_path(log_dir: str, rank: int, spec: ServerSpec) -> str:
    node = f"_node{spec.node_rank}" if spec.nnodes > 1 else ""
    return os.path.join(log_dir, f"engine_{rank}{node}.log")


class EngineActor:
    def __init__(self, spec: ServerSpec, rank: int, log_dir: str, startup_timeout: float):
        self.spec, self.rank = spec, rank
        self.log_path = engine_log_path(log_dir, rank, spec)
        self.startup_timeout = startup_timeout
        self.proc = None
        self.url: Optional[str] = None
        self.base_gpu = 0
        self.started: Optional[float] = None  # time.time() of the server's last start, and when it answered
        self.ready: Optional[float] = None
        self.prebuild = None  # Engine.prebuild_command's process, beside the server's first start; its log, report
        self.prebuild_log, self.prebuild_report = (os.path.splitext(self.log_path)[0] + f"_prebuild.{ext}"
                                                   for ext in ("log", "json"))

    def reserve_dist_init_addr(self) -> str:
        """Node 0 of a multi-node engine: the address the other nodes join."""
        host = node_ip()
        return f"{host}:{free_port(host)}"

    def set_dist_init_addr(self, addr: str) -> None:
        from dataclasses import replace

        self.spec = replace(self.spec, dist_init_addr=addr)

    def start(self) -> Optional[str]:
        """Start the server (again, after a failure: a new process on the same GPUs); node 0 returns its URL once
        /health_generate answers, the other nodes None once their process runs."""
        if self.proc is not None:
            self.kill()
        host, port = node_ip(), free_port(node_ip())
        cmd = self.command(host, port)
        engine = make_engine(self.spec)
        env = engine.env()
        for name in engine.unset_env:
            os.environ.pop(name, None)
        with open(self.log_path, "a") as f:
            f.write("$ " + " ".join(redact_argv(cmd)) + "\n")
        self.started, self.ready = time.time(), None
        prebuild = engine.prebuild_command(self.prebuild_report) if self.prebuild is None else None
        if prebuild:  # the first start only
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.prebuild_report)  # a resumed run's old one
            with open(self.prebuild_log, "a") as f:
                f.write("$ " + " ".join(redact_argv(prebuild)) + "\n")
            self.prebuild = spawn(prebuild, self.prebuild_log, env)
        self.proc = spawn(cmd, self.log_path, env)
        if self.spec.node_rank > 0:
            return None
        self.url = f"http://{host}:{port}"
        wait_http(self.url + "/health_generate", self.proc, self.startup_timeout, self.log_path)
        self.ready = time.time()
        return self.url

    def startup_report(self) -> Dict[str, Any]:
        """The server's last start: when it began and answered (``time.time()``), its parts (``startup_parts``)."""
        parts: Dict[str, float] = {}
        if self.started is not None and self.ready is not None:
            try:
                with open(self.log_path, errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            since = text.rfind("\n$ ") + 1  # this start's lines: after the last command line written
            parts = make_engine(self.spec).startup_parts(text[since:], self.started, self.ready)
        report = {"rank": self.rank, "started": self.started, "ready": self.ready, "parts": parts}
        if self.prebuild is not None and self.prebuild.poll() is not None:
            with contextlib.suppress(OSError, ValueError), open(self.prebuild_report) as f:
                report["prebuild"] = json.load(f)
        return report

    def command(self, host: Optional[str] = None, port: int = 0):
        """The server's command line on this node, from its first GPU as Ray assigned it."""
        import ray

        host = host or node_ip()
        gpu_ids = ray.get_gpu_ids() if self.spec.device == "cuda" else []
        self.base_gpu = int(min(map(int, gpu_ids))) if gpu_ids else 0
        return make_engine(self.spec).command(host, port, self.base_gpu, nccl_port=free_port(host))

    def first_gpu(self) -> int:
        """The physical GPU of the server's first tensor-parallel rank on this node (SGLang's ``base_gpu_id``)."""
        return self.base_gpu

    def failure(self) -> Optional[str]:
        """None while the server runs (or before it starts, or after stop()); else how it ended."""
        if self.proc is None or self.proc.poll() is None:
            return None
        node = f" node {self.spec.node_rank}" if self.spec.nnodes > 1 else ""
        return (f"engine {self.rank}{node} ({self.url or 'no URL'}) exited with code {self.proc.returncode}; "
                f"last lines of {self.log_path}:\n{tail(self.log_path)}")

    def stop(self) -> None:
        kill_tree(self.prebuild)
        kill_tree(self.proc)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a frozen server ignores SIGTERM)."""
        kill_tree(self.proc, timeout=0)
        self.proc = None

    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None


def join_nodes(actors: List[Any]) -> None:
    """An engine that spans nodes: node 0 reserves the address where the other nodes join it."""
    import ray

    if len(actors) > 1:
        addr = ray.get(actors[0].reserve_dist_init_addr.remote())
        ray.get([a.set_dist_init_addr.remote(addr) for a in actors])
