"""Preemption (docs/operations.md): SIGTERM, or ``trainer.preempt_signal`` (Slurm's ``--signal=B:USR1@180``),
stops the run at the next safe point, saves the last step done and exits with 128 + the signal's number, all
within ``trainer.preempt_grace_s``; ``trainer.resume=auto`` then goes on with no step lost.

The handler only notes the signal: an exception raised at any bytecode can break the library code it lands
in (Ray's deserialisation). The loop raises :class:`Preempted` at its safe points (``check``): a rollout under
way is dropped (its prompts are drawn again on resume: the checkpoint holds the data position before it);
from the training of a step to its row, the step finishes first. Before the first step there is nothing to
save: the run exits at once (the lease's watchdog ends its processes). Ctrl-C is not a preemption: it stops
at once, and the last periodic checkpoint resumes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

from slime_hydra.checkpoint.ckpt import complete_checkpoints
from slime_hydra.logging.metrics import write_json_atomic

log = logging.getLogger("slime_hydra")
STARTING = ("start-up", "first push")  # the run's moments (Parts.moment) before its first step
# a signal before the first step ends the process at once; a sweep's worker raises Preempted instead (its exit
# would break the process pool of the other jobs, sweep/launcher.py)
EXIT_BEFORE_FIRST_STEP = True


class Preempted(BaseException):
    """Raised at a safe point of the loop (``check``); a BaseException, as Ctrl-C's: nothing heals it."""

    def __init__(self, signum: int, note: str = ""):
        super().__init__(f"preempted by {signal.Signals(signum).name}")
        self.signum, self.note = signum, note
        self.said = False  # its line is in the log and on the console already

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # as a shell reports a process the signal ended: 143 for SIGTERM, 138 for USR1


class _State:
    signum: Optional[int] = None
    starting: Callable[[], bool] = staticmethod(lambda: True)
    timer: Optional[threading.Timer] = None


@contextlib.contextmanager
def handling(trainer_cfg: Any) -> Iterator[None]:
    """Around a run: no preemption pending at its start, the signals' previous handlers back at its end."""
    previous = {s: signal.getsignal(s) for s in signals(trainer_cfg)}
    _State.signum, _State.starting = None, (lambda: True)
    install(trainer_cfg)
    try:
        yield
    finally:
        if _State.timer is not None:
            _State.timer.cancel()
        _State.timer, _State.starting = None, (lambda: True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def install(trainer_cfg: Any) -> None:
    """Handle the preemption signals in this (the main) thread. Again after ``ray.init``: Ray's core worker
    installs a native handler (absl's failure signal handler) that prints a stack dump for SIGTERM before
    calling the one it found; installing ours after it replaces it."""
    handler = lambda signum, _frame: _on_signal(signum, trainer_cfg.preempt_grace_s)  # noqa: E731
    for s in signals(trainer_cfg):
        signal.signal(s, handler)


def signals(trainer_cfg: Any) -> List[signal.Signals]:
    """SIGTERM and ``trainer.preempt_signal``."""
    extra = trainer_cfg.preempt_signal
    return [signal.SIGTERM] + ([signal.Signals[f"SIG{extra}"]] if extra and extra != "TERM" else [])


def starting(test: Callable[[], bool]) -> None:
    """``test()``: whether the run has not begun its first step (a signal then ends the process at once)."""
    _State.starting = test


def check() -> None:
    """A safe point of the loop: raise :class:`Preempted` if a preemption signal came."""
    if _State.signum is not None:
        raise Preempted(_State.signum)


def _on_signal(signum: int, grace_s: float) -> None:
    if _State.signum is not None:
        return
    _State.signum = signum
    if _State.starting():
        if not EXIT_BEFORE_FIRST_STEP:
            raise Preempted(signum, "nothing to save before the first step")
        _exit(signum, "nothing to save before the first step; go on with trainer.resume=auto")
    log.warning("%s: preempted; saving at the next safe point, then stopping (trainer.preempt_grace_s=%g)",
                signal.Signals(signum).name, grace_s)
    _State.timer = threading.Timer(grace_s, _exit, (signum, f"trainer.preempt_grace_s={grace_s:g} ran out before "
                                   "the checkpoint was saved; trainer.resume=auto goes on from the last complete one"))
    _State.timer.daemon = True
    _State.timer.start()


def _exit(signum: int, why: str) -> None:
    """Out now, with one line (the run's processes die with the driver: launch/lease.py's watchdog)."""
    print(f"preempted by {signal.Signals(signum).name}: {why}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(128 + signum)


def wind_down(run: Any, err: Preempted) -> Dict[str, Any]:
    """After :class:`Preempted` left the loop: save the last step done (unless saved), record the run as preempted
    in summary.json and the log; the summary."""
    done = run.done
    saved = complete_checkpoints(run.run_dir)[-1:] == [f"step_{done:06d}"]
    if done > 0 and not saved:
        run.save(done)  # the trainers hold step `done`'s weights: a step is dropped only before its training
    if _State.timer is not None:
        _State.timer.cancel()
    latest = complete_checkpoints(run.run_dir)[-1:]
    err.note = (f"step {done} saved" if latest else "nothing to save") + " (go on with trainer.resume=auto)"
    name = signal.Signals(err.signum).name
    run.logger.write(f"{err}: {err.note}")
    err.said = True
    summary = {"status": "preempted", "signal": name, "exit_code": err.exit_code, "steps_done": done,
               "steps": run.num_rollout, "checkpoint": latest[0] if latest else None, "run_dir": run.run_dir}
    write_json_atomic(os.path.join(run.run_dir, "summary.json"), summary)  # no plot: the resumed run draws it
    return summary
