"""User reward functions for the reward-pool tests (imported by spec string, also in spawned workers)."""

import time


def length_reward(completions, answers):
    """len(completion) as a float."""
    return [float(len(c)) for c in completions]


def fragile_reward(completions, answers):
    """1.0 for a correct answer; raises on the completion "boom" and on non-digit answers."""
    out = []
    for c, a in zip(completions, answers):
        if c == "boom":
            raise ValueError(f"cannot score {c!r}")
        out.append(float(int(c) == int(a)))
    return out


def prompt_aware(completions, answers, prompts):
    """1.0 when the completion repeats the prompt's first character."""
    return [float(bool(p) and c.startswith(p[0])) for p, c in zip(prompts, completions)]


def wrong_length(completions, answers):
    return [1.0]


def not_a_number(completions, answers):
    return ["high" if c == "x" else 0.5 for c in completions]


def slow_on_sleep(completions, answers):
    if "sleep" in completions:
        time.sleep(60)
    return [1.0 for _ in completions]


NOT_CALLABLE = 3


def sleeps_on_sleep(completions, answers):
    """1.0 per sample; a sample "sleep" hangs (its call, not its neighbours', is stopped)."""
    for c in completions:
        if c == "sleep":
            time.sleep(600)
    return [1.0 for _ in completions]


def crashes_on_crash(completions, answers):
    """1.0 per sample; the sample "crash" kills its process (as a segfault would)."""
    import os

    if "crash" in completions:
        os._exit(3)
    return [1.0 for _ in completions]


def exits_on_exit(completions, answers):
    """1.0 per sample; the sample "exit" raises SystemExit."""
    if "exit" in completions:
        raise SystemExit(2)
    return [1.0 for _ in completions]


def from_rows(completions, answers, rows):
    """Each row's ``bonus`` field (rows carry every field of the dataset row)."""
    return [float(r["bonus"]) for r in rows]


def runs_in_sandbox(completions, answers):
    """Run each completion as a Python program in the sandbox: 1.0 when it prints the answer."""
    from flowrl.sandbox import run_code

    return [float(run_code(c, timeout_s=1.0).stdout.strip() == a) for c, a in zip(completions, answers)]


def killed_once(completions, answers):
    """1.0 per sample; a sample "killed:PATH" has its process killed from outside (SIGKILL, as the OOM
    killer or an operator would) the first time it is scored, marked by creating PATH."""
    import os
    import signal

    for c in completions:
        if c.startswith("killed:") and not os.path.exists(c[len("killed:"):]):
            open(c[len("killed:"):], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return [1.0 for _ in completions]


def prints_and_fails(completions, answers):
    """1.0 per sample, printing as it goes; "loud" writes to stderr and from a subprocess too; "boom" raises."""
    import subprocess
    import sys

    for c in completions:
        print("scoring", c)
        if c == "loud":
            print("to stderr", file=sys.stderr)
            sys.stderr.flush()
            subprocess.run(["echo", "from a subprocess"], check=True)
        if c == "boom":
            raise ValueError(f"cannot score {c!r}")
    return [1.0 for _ in completions]


def prints_a_lot(completions, answers):
    import sys

    sys.stdout.write("y" * 10 ** 6)
    return [1.0 for _ in completions]
