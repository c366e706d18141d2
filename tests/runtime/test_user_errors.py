"""Which failures are the user's (one line) and which are bugs: :func:`flowrl.runtime.errors.user_error`."""

from __future__ import annotations

import subprocess
import sys


def test_a_user_error_of_any_listed_module_is_one_line_and_a_bug_is_none():
    from flowrl.runtime.errors import RuntimeFlowError, user_error
    from flowrl.runtime.weight_sync import WeightSyncError

    assert user_error(RuntimeFlowError("flows/x.flow:3:1: refused\ndetails")) == "flows/x.flow:3:1: refused"
    try:
        try:
            raise WeightSyncError("bucket 2: checksum mismatch")
        except WeightSyncError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert user_error(outer) == "bucket 2: checksum mismatch"
    assert user_error(KeyError("x")) is None


def test_classifying_an_error_imports_nothing():
    """A refusal before any model is prepared (the host-memory check) is reported at once: classifying it
    imports no module whose errors could not have been raised (flowrl.models pulls in transformers: 10 s)."""
    code = ("import sys\nfrom flowrl.runtime.errors import RuntimeFlowError, user_error\n"
            "assert user_error(RuntimeFlowError('no')) == 'no'\nassert user_error(ValueError('x')) is None\n"
            "print(sorted(m for m in ('flowrl.models', 'transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
