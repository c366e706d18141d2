"""Environments the multi-turn tests run (named by their flows as ``python_env("loop_envs:Class")``)."""

from __future__ import annotations

import os
import threading
import time

from flowrl.envs import StepResult


class TwoToolCalls:
    """Answers every turn with the observation ``+=`` for two turns (tool calls), then ends the episode
    with reward 1; the row whose prompt is ``CRASH`` raises, ``HANG`` sleeps past any timeout."""

    def reset(self, row: dict) -> None:
        self.row = row
        self.turns = 0

    def step(self, turn: str) -> StepResult:
        if self.row.get("prompt") == "CRASH":
            raise ValueError("the tool broke")
        if self.row.get("prompt") == "HANG":
            time.sleep(60)
        self.turns += 1
        if self.turns <= 2:
            return StepResult("+=", 0.25, False, {"tool_call": True, "tool_error": self.turns == 2})
        return StepResult("", 1.0, True)


class DoneAtOnce:
    """Every episode ends at its first step."""

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn: str):
        return ("", 0.5, True)


class Rendezvous:
    """A step returns only once four steps are running at the same time in this process: it proves the
    worker runs episodes' calls concurrently (serialized calls would time out at the barrier)."""

    barrier = threading.Barrier(4, timeout=20)

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn: str) -> StepResult:
        self.barrier.wait()
        return StepResult("ok", 1.0, True)


class Crashy:
    """Kills its worker process on the row whose prompt is ``EXIT``; raises on ``RAISE``; else it ends."""

    def reset(self, row: dict) -> None:
        self.prompt = row.get("prompt")

    def step(self, turn: str):
        if self.prompt == "EXIT":
            os._exit(3)
        if self.prompt == "RAISE":
            raise RuntimeError("boom")
        if self.prompt == "BAD":
            return {"observation": "not a StepResult"}
        return StepResult(f"seen {turn}", 1.0, False)


class Counter:
    """Counts its steps: each observation is "<n> <turn>". A turn "KILL:PATH" kills the worker process
    from outside (SIGKILL) the first time, marked by creating PATH."""

    def reset(self, row: dict) -> None:
        self.n = 0

    def step(self, turn: str) -> StepResult:
        import signal

        if turn.startswith("KILL:") and not os.path.exists(turn[5:]):
            open(turn[5:], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.n += 1
        return StepResult(f"{self.n} {turn}", 0.0, False)


class Chatty:
    """Prints on stdout and stderr at each step (what the runtime keeps out of the terminal)."""

    def reset(self, row: dict) -> None:
        self.prompt = row.get("prompt")

    def step(self, turn: str) -> StepResult:
        import sys

        print(f"env {self.prompt} got {turn}")
        print("to stderr", file=sys.stderr)
        if self.prompt == "RAISE":
            raise RuntimeError("boom")
        return StepResult("ok", 1.0, True)
