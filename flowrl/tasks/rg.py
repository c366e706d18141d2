"""Reasoning Gym tasks small enough for a tiny model: the splits of ``reasoning_gym(...)`` datasets.

Each task here is one Reasoning Gym generator with a config whose questions and answers are
short (two 1-2 digit numbers; a 3-5 letter word), so the tiny character-level model of
``tiny(task = "rg_chain_sum")`` can learn it on CPU. Its rows are exactly those of the dataset
a flow declares with the same settings (:func:`flowrl.data.reasoning_gym.generate_splits`):

    dataset d = reasoning_gym("chain_sum", size = 4000, seed = 1, eval_size = 200,
                              min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 2)

so the warm start trains on the flow's training split and the flow's held-out split is held
out from both (``flows/rg_*.flow``; ``tests/models/test_rg_tasks.py`` keeps the flows and these
settings equal). Rows are ``{"prompt": question, "answer": answer}``; completions are scored by
the task's own ``score_answer`` (the ``reasoning_gym`` verifier). ``CHARS`` of each task is
every character its questions and answers use (the tiny tokenizer's charset; a test regenerates
the splits and compares).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RGTask:
    """The settings of one tiny Reasoning Gym task (those of its flows' ``reasoning_gym(...)`` dataset)."""

    task: str
    """The reasoning_gym generator."""
    config: dict = field(default_factory=dict)
    """The generator's config (its dataclass's options)."""
    chars: str = ""
    """Every character of its questions and answers."""
    max_answer: int = 4
    """The longest answer, in characters."""
    size: int = 4000
    seed: int = 1
    eval_size: int = 200

    def make_splits(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """``(train, test)`` rows ``{"prompt", "answer"}``: the dataset's training split, each question once
        (a small task repeats questions: 4000 rows of two 1-2 digit numbers ask ~2100), and its held-out split.

        Once: the warm start validates on its first rows and trains on the rest (``SFTConfig.check_rows``);
        with repeats, those rows were trained on too and the check measured memory (30% on them, 2% held out)."""
        from flowrl.data.reasoning_gym import ANSWER, PROMPT, generate_splits

        train, held = generate_splits(self.task, self.config, size=self.size, seed=self.seed, eval_size=self.eval_size)
        once = {r[PROMPT]: r[ANSWER] for r in train}  # first occurrences, in order (an answer is the question's)
        return ([{"prompt": q, "answer": a} for q, a in once.items()],
                [{"prompt": r[PROMPT], "answer": r[ANSWER]} for r in held])

    def spec(self) -> dict:
        return {"reasoning_gym": self.task, "config": dict(sorted(self.config.items())), "size": self.size,
                "seed": self.seed, "eval_size": self.eval_size}


RG_TASKS: dict[str, RGTask] = {
    # "State the final answer to the following arithmetic problem: 57 + 87 =" -> "144" (+ and -)
    "rg_chain_sum": RGTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                           chars=" +-0123456789:=Sabcefghilmnoprstw"),
    # "Calculate 56 - 33." -> "23"
    "rg_basic_arithmetic": RGTask("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                       "operators": ["+", "-"], "allow_parentheses": False,
                                                       "allow_negation": False},
                                  chars=" +-.0123456789Caceltu"),
    # "Spell this word backward (example: sun -> nus): bird" -> "drib"
    "rg_spell_backward": RGTask("spell_backward", {"min_word_len": 3, "max_word_len": 5}, max_answer=5,
                                chars=" ()-:>ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"),
}
"""The tiny Reasoning Gym tasks by their flowrl task name."""


__all__ = ["RGTask", "RG_TASKS"]
