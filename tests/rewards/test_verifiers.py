"""flowrl.rewards.verifiers: the built-in named verifiers."""

import pytest

from flowrl.rewards.verifiers import VERIFIERS, UnknownVerifierError, get_verifier


def test_exact_strips_whitespace():
    assert get_verifier("exact")([" 47\n", "47", "470", ""], ["47", " 47 ", "47", "0"]) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("47", "47", 1.0),
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("1/2", "\\frac{1}{2}", 1.0),
        ("-5", "-5", 1.0),
        ("48", "47", 0.0),
        ("no number here", "47", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_equivalence(completion, answer, expected):
    assert get_verifier("math")([completion], [answer]) == [expected]


def test_math_runs_off_the_main_thread():
    # math_verify's signal-based timeouts only work on the main thread; off it they are disabled.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(get_verifier("math"), ["12", "13"], ["12", "12"]).result() == [1.0, 0.0]


def test_length_mismatch_and_unknown_name():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        VERIFIERS["exact"](["a", "b"], ["a"])
    with pytest.raises(UnknownVerifierError, match=r"unknown verifier 'maths'.*\['code', 'exact', 'final', 'math', 'reasoning_gym'\].*module:function"):
        get_verifier("maths")
