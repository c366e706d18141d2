"""SIGTERM as a scheduler sends it: the guard's two signals, and what `flowrl run` says and returns.
The run loop's side (checkpoint at the step boundary, exact resume) is in test_e2e.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from flowrl.cli import main
from flowrl.runtime.preemption import Preempted, SigtermGuard


def test_first_sigterm_asks_second_stops_at_once_and_the_handler_is_restored():
    notes = []
    before = signal.getsignal(signal.SIGTERM)
    with SigtermGuard(note=notes.append) as guard:
        assert not guard.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and len(notes) == 1 and "SIGTERM again: stop at once" in notes[0]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_guard_takes_sigterm_back_from_a_later_handler_and_restores_the_first():
    before = signal.getsignal(signal.SIGTERM)
    with SigtermGuard(note=lambda m: None) as guard:
        signal.signal(signal.SIGTERM, lambda *a: None)  # as ray.init does when a run starts Ray
        guard.reclaim()
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_nothing_is_installed():
    seen = {}

    def body():
        with SigtermGuard(note=print) as guard:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            seen["installed"] = guard._installed

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"handler": signal.getsignal(signal.SIGTERM), "installed": False}


@pytest.mark.parametrize("step, checkpoint, says", [
    (3, True, "its checkpoint of step 3 is written; `flowrl run --resume runs/x` continues it"),
    (2, False, "`flowrl run --resume runs/x` continues it from its last checkpoint"),
    (0, False, "no step had finished, so there is nothing to resume: run it again"),
])
def test_flowrl_run_reports_a_preemption_and_exits_0(monkeypatch, capsys, tmp_path, step, checkpoint, says):
    import flowrl.launch

    def preempted(*args, **kwargs):
        raise Preempted("runs/x", step, 10, checkpoint)

    monkeypatch.setattr(flowrl.launch, "run_file", preempted)
    flow = tmp_path / "a.flow"
    flow.write_text("")
    assert main(["run", str(flow)]) == 0
    err = capsys.readouterr().err
    assert err.strip() == f"flowrl: preempted (SIGTERM) after step {step} of 10; {says}"
