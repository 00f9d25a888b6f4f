"""launch/preempt.py without a run: the signal is noted (not raised) and raised at the next ``check``; the
handlers before the run come back after it."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from slime_hydra.launch import preempt

TRAINER = SimpleNamespace(preempt_signal="USR1", preempt_grace_s=30.0)


def test_a_signal_is_raised_at_the_next_check_with_its_exit_status():
    before = signal.getsignal(signal.SIGUSR1)
    with preempt.handling(TRAINER):
        preempt.starting(lambda: False)  # the run is past its start-up
        preempt.check()  # nothing pending
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(preempt.Preempted) as err:
            preempt.check()
        assert err.value.exit_code == 138 and str(err.value) == "preempted by SIGUSR1"
        assert preempt._State.timer is not None and preempt._State.timer.is_alive()  # the grace period runs
    assert preempt._State.timer is None and signal.getsignal(signal.SIGUSR1) == before
    with preempt.handling(TRAINER):
        preempt.check()  # a new run starts with nothing pending


def test_sigterm_alone_when_no_other_signal_is_named():
    assert preempt.signals(SimpleNamespace(preempt_signal=None)) == [signal.SIGTERM]
    assert preempt.signals(SimpleNamespace(preempt_signal="TERM")) == [signal.SIGTERM]
    assert preempt.signals(TRAINER) == [signal.SIGTERM, signal.SIGUSR1]
