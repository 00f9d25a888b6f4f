"""sglang-router (a Rust binary), a child process of the rollout manager that comes up while the engines start.
Engines register with ``POST /workers`` once healthy; its own health checks and circuit breaker are off (as in
slime: the manager checks engine health)."""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import httpx

from slime_hydra.config.schema import RouterConfig
from slime_hydra.utils.proc import free_port, kill_tree, spawn, wait_http

log = logging.getLogger(__name__)


def router_command(host: str, port: int, cfg: RouterConfig) -> List[str]:
    args: Dict[str, Any] = {"policy": cfg.policy, "request-timeout-secs": cfg.request_timeout_secs,
                            "prometheus-port": free_port(host), "prometheus-host": host, "log-level": "warn",
                            "max-concurrent-requests": -1, "disable-circuit-breaker": True,
                            "disable-health-check": True, **{k.replace("_", "-"): v for k, v in cfg.args.items()}}
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    for key, value in args.items():
        if value is True:
            cmd.append(f"--{key}")
        elif value not in (False, None):
            cmd += [f"--{key}", str(value)]
    return cmd


class Router:
    def __init__(self, cfg: RouterConfig, host: str, log_path: str, startup_timeout: float = 60.0,
                 wait: bool = True, port: Optional[int] = None):
        """Spawn sglang-router on ``port`` (None: a free one); with ``wait``, return once it answers, else
        ``wait_ready`` waits."""
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path, self.policy = log_path, cfg.policy
        self.proc = spawn(router_command(host, self.port, cfg), log_path)
        pool = ThreadPoolExecutor(1, thread_name_prefix="router-start")
        self._up = pool.submit(self._wait_healthy, startup_timeout, time.perf_counter())
        pool.shutdown(wait=False)  # its thread ends once the router answers, fails or is stopped
        if wait:
            self.wait_ready()

    def _wait_healthy(self, timeout: float, t0: float) -> None:
        wait_http(self.url + "/health", self.proc, timeout, self.log_path, interval=0.2)
        log.info("sglang-router at %s (policy %s) up in %.1fs", self.url, self.policy, time.perf_counter() - t0)

    def wait_ready(self) -> None:
        """Until the router answers; raises if it exited first (with its log's tail) or timed out."""
        self._up.result()

    def workers(self) -> List[Dict[str, Any]]:
        return httpx.get(self.url + "/workers", timeout=30).json().get("workers", [])

    def add_worker(self, url: str, timeout: float = 60.0) -> None:
        """Register and wait until the router lists the worker as healthy (registration is async)."""
        r = httpx.post(self.url + "/workers", json={"url": url, "worker_type": "regular"}, timeout=30)
        if r.status_code >= 300:
            raise RuntimeError(f"router refused worker {url}: HTTP {r.status_code} {r.text}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(w["url"] == url and w.get("is_healthy", True) for w in self.workers()):
                return
            time.sleep(0.1)
        raise TimeoutError(f"router did not list {url} within {timeout:.0f}s; see {self.log_path}")

    def remove_worker(self, url: str) -> None:
        for w in self.workers():
            if w["url"] == url:
                httpx.delete(f"{self.url}/workers/{w['id']}", timeout=30)

    def stop(self) -> None:
        kill_tree(self.proc)
