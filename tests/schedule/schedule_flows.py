"""Flow texts shared by the schedule tests (imported by name, like tests/cli/cli_flows.py)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

GRPO_BODY = """dataset prompts = jsonl("prompts.jsonl")
reward r = verifier("math")

flow main() {{
  ref      = frozen(policy)
  b        = sample(prompts, size = {batch})
  rollouts = generate(policy, b, n = {n}, max_tokens = {max_tokens})
  old_lp   = logprobs(policy, rollouts)
  ref_lp   = logprobs(ref, rollouts)
  adv      = group_advantage(r(rollouts), group = {n})
  update(policy, rollouts, adv, old_lp, ref_lp, kl = 0.001)  # kl > 0: the reference runs
}}
"""


def grpo(model: str = 'tiny(task = "arith")', schedule: str = "", batch: int = 64, n: int = 8,
         max_tokens: int = 64) -> str:
    """A GRPO flow text with ``model`` as the policy and ``schedule`` (a whole schedule block) after it."""
    return f"model policy = {model}\n" + GRPO_BODY.format(batch=batch, n=n, max_tokens=max_tokens) + "\n" + schedule
