"""Keep secrets out of what a run writes: tokens and keys from the environment never reach
``events.log``, ``trace.json`` or the progress lines.

A secret is the value of an environment variable whose name says it is one (``*_TOKEN``,
``*_KEY``, ``*_SECRET``, ``*PASSWORD*``, ``*_CREDENTIALS``: ``HF_TOKEN``, ``WANDB_API_KEY``,
``RAY_AUTH_TOKEN``...) and that is long enough to be one (8 characters or more: a short value
such as ``1`` would blank out innocent text). :func:`redact` replaces each such value by
``***`` (its variable named, so the reader knows what was there). No process the run starts
gets them (Ray's own, its actors, reward workers): :mod:`flowrl.runtime.environment` is the one
policy of what each gets.

>>> redact("login with hf_abcdefghij failed", {"HF_TOKEN": "hf_abcdefghij", "STEPS": "12345678"})
'login with ***HF_TOKEN*** failed'
>>> is_secret_name("WANDB_API_KEY"), is_secret_name("KEYBOARD"), is_secret_name("TOKENIZERS_PARALLELISM")
(True, False, False)
"""

from __future__ import annotations

import os
import re
from typing import Mapping

SECRET_NAME = re.compile(r"(_TOKEN|_KEY|_SECRET|_CREDENTIALS?|PASSWORD|PASSWD)$|^(TOKEN|SECRET|API_KEY)$|PASSWORD",
                         re.IGNORECASE)
"""Environment variable names whose values are secrets."""
MIN_SECRET_LENGTH = 8
"""Shorter values are not redacted (they are not credentials, and would blank out ordinary text)."""


def is_secret_name(name: str) -> bool:
    """Whether an environment variable of this name holds a secret (see the module docstring)."""
    return bool(SECRET_NAME.search(name))


def secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{value: variable name}`` of the secrets in ``environ`` (default: this process's), longest first."""
    env = os.environ if environ is None else environ
    found = {v: k for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LENGTH}
    return dict(sorted(found.items(), key=lambda kv: -len(kv[0])))


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with every secret of ``environ`` (default: this process's) replaced by ``***NAME***``."""
    for value, name in secrets(environ).items():
        if value in text:
            text = text.replace(value, f"***{name}***")
    return text


__all__ = ["SECRET_NAME", "MIN_SECRET_LENGTH", "is_secret_name", "secrets", "redact"]
