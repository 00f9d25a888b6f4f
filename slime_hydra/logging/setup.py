"""Log set-up for Ray actors: each writes ``<run dir>/logs/<name>.log``; warnings also go to stderr."""

from __future__ import annotations

import logging
import os
import sys


def setup_actor_logging(cfg, name: str) -> None:
    os.makedirs(os.path.join(cfg.output_dir, "logs"), exist_ok=True)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(cfg.logging.level)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)-5s [{name}] %(message)s", "%H:%M:%S")
    file = logging.FileHandler(os.path.join(cfg.output_dir, "logs", f"{name}.log"))
    file.setFormatter(fmt)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    err.setFormatter(fmt)
    root.addHandler(file)
    root.addHandler(err)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
