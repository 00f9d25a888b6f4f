"""Test hook: hold a run at a named moment so that a fault test can kill a part exactly there.

``SLIME_HYDRA_TEST_HOLD="push:3,push:5"``, ``SLIME_HYDRA_TEST_HOLD_DIR=<dir>``: the first process to reach
moment ``push`` of step 3 creates ``<dir>/push_3`` and waits until ``<dir>/push_3.go`` exists (at most
``WAIT_S``), once. Moments: ``push`` (the pushing trainer rank, engines paused, before the weights go)."""

from __future__ import annotations

import os
import time

HOLD_ENV, DIR_ENV = "SLIME_HYDRA_TEST_HOLD", "SLIME_HYDRA_TEST_HOLD_DIR"
WAIT_S = 120.0


def hold(moment: str, step: int) -> None:
    wanted = os.environ.get(HOLD_ENV)
    if not wanted or f"{moment}:{step}" not in wanted.split(","):
        return
    marker = os.path.join(os.environ[DIR_ENV], f"{moment}_{step}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # one holder, once
    except FileExistsError:
        return
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(marker + ".go") and time.monotonic() < deadline:
        time.sleep(0.02)
