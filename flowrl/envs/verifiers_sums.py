"""A `verifiers` taskset written in verifiers' own API (``verifiers.v1``): sums for the tiny ``arith`` model.

Each task's prompt is ``"A+B="`` (the tiny ``arith`` tokenizer's characters), its data holds the
answer, and its ``@vf.reward`` method scores the reply: 1.0 when it is the sum. A taskset module
exports its ``Taskset`` subclass in ``__all__`` (how verifiers finds it); flowrl trains it with
``verifiers("flowrl.envs.verifiers_sums")`` (``flows/verifiers_sums.flow``, docs/agents.md).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if trace.last_reply.strip().rstrip("=") == self.data.answer else 0.0


class SumsConfig(vf.TasksetConfig):
    size: int = 200
    seed: int = 0


class Sums(vf.Taskset[SumTask, SumsConfig]):
    """``size`` two-digit sums drawn with ``seed``."""

    def load(self):
        rng = random.Random(self.config.seed)
        for _ in range(self.config.size):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["Sums", "SumTask", "SumData", "SumsConfig"]
