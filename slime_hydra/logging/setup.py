"""Log set-up for Ray actors: each writes ``<run dir>/logs/<name>.log``; warnings also go to stderr."""

from __future__ import annotations

import logging
import os
import sys


def setup_actor_logging(cfg, name: str) -> None:
    logs = os.path.join(cfg.output_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(cfg.logging.level)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)-5s [{name}] %(message)s", "%H:%M:%S")
    file, err = logging.FileHandler(os.path.join(logs, f"{name}.log")), logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (file, err):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
