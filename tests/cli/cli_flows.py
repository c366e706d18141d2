"""Small inline .flow programs shared by the CLI tests (no stdlib needed)."""

# GRPO inlined into `main`: a trainable policy, a frozen reference, a resync, loop-carried weights.
GRPO = """\
model policy = tiny(task = "arith")
dataset arith = jsonl("data/train.jsonl")
reward exact = verifier("math")

flow grpo(policy: model, prompts: dataset, reward: reward, group: int = 8) {
  ref = frozen(policy)
  b = sample(prompts, size = 16)
  rollouts = generate(policy, b, n = group, max_tokens = 16)
  scores = reward(rollouts)
  old_lp = logprobs(policy, rollouts)
  ref_lp = logprobs(ref, rollouts)
  adv = group_advantage(scores, group = group)
  update(policy, rollouts, adv, old_lp, ref_lp, loss = ppo_clip(0.2), kl = 0.001)
}

flow main() {
  grpo(policy, arith, exact, group = 4)
}
"""

# PPO with a critic and a multi-turn `repeat` loop (a TURN edge).
PPO_TURNS = """\
model policy = tiny()
dataset data = jsonl("d.jsonl")
reward exact = verifier("exact")
env calc = python_env("tools:Calc")

flow main() {
  critic = critic(policy)
  b = sample(data, size = 8)
  convo = generate(policy, b, max_tokens = 8)
  repeat 3 until done {
    obs = env_step(calc, convo)
    convo = generate(policy, obs)
  }
  scores = exact(convo)
  old_lp = logprobs(policy, convo)
  vals = values(critic, convo)
  ar = gae(scores, vals, convo)
  update(policy, convo, ar, old_lp, loss = ppo_clip(0.2))
  update(critic, convo, ar, vals, loss = value_clip(0.2))
}
"""

# Two calls of one flow: two clusters (`inner`, `inner#2`). Each call trains its own model,
# so neither is dead code (an unread value would be removed, with a warning).
TWO_CALLS = """\
flow inner(m: model, d: dataset, rw: reward) {
  b = sample(d, size = 4)
  r = generate(m, b, n = 2)
  s = rw(r)
  a = group_advantage(s, group = 2)
  update(m, r, a, loss = pg())
}

flow main() {
  policy = tiny()
  other = tiny()
  data = jsonl("x.jsonl")
  exact = verifier("exact")
  inner(policy, data, exact)
  inner(other, data, exact)
}
"""

# A misspelt name: E101 at line 4.
UNKNOWN_NAME = """\
flow main(m: model, d: dataset) {
  b = sample(d)
  rollouts = generate(m, b)
  s = score(rolouts)
}
"""

SYNTAX_ERROR = "flow main( {\n  b = sample(d)\n"

# Valid but not in canonical layout; FORMATTED is its canonical form.
MESSY = "# top comment\nflow main(m: model,d: dataset){b=sample(d,size=4)   # keep me\nr=generate(m,b)}\n"
FORMATTED = ("# top comment\nflow main(m: model, d: dataset) {\n  b = sample(d, size = 4)  # keep me\n"
             "  r = generate(m, b)\n}\n")
