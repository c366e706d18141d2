"""The driver writes a run's summary and curves on a thread of its own while the engines shut down
(`flowrl.runtime.driver._in_background`): it runs beside the caller and hands back what it raised."""

from __future__ import annotations

import threading

from flowrl.runtime.driver import _in_background


def test_the_work_runs_beside_the_caller_and_waiting_for_it_returns_once_done():
    started, release, done = threading.Event(), threading.Event(), []

    def work(tag):
        started.set()
        release.wait(10)
        done.append(tag)

    job = _in_background(work, "written")
    assert started.wait(10)  # running while this thread goes on (as the engines shut down)
    assert done == []
    release.set()
    assert job.exception() is None
    assert done == ["written"]


def test_waiting_hands_back_the_error_for_the_driver_to_report():
    def work():
        raise OSError("disk full")

    error = _in_background(work).exception()
    assert isinstance(error, OSError) and str(error) == "disk full"
