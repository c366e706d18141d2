"""Checking keyword options (of ops, losses, engines, protocols) against ``KwSpec`` tables."""

from __future__ import annotations

import difflib

from flowrl.diagnostics import Collector, Span, did_you_mean
from flowrl.ir.graph import Config, Const, Ref, Symbol, Value
from flowrl.catalog.ops import CONFIG_TABLES, KwSpec


PLANNED = {"int": 2**40, "size": 2**50, "float": 2.0**40}
"""The largest magnitude of a number option (a count, a size in bytes, a float) that flowrl
plans: a batch of 2^40 prompts or a petabyte of memory is a typo, and refusing it (E222) keeps
every estimate of the compiler small and fast whatever the flow says."""
PLANNED_SHOWN = {"int": "2^40", "size": "1 PiB", "float": "2^40"}


def short(v) -> str:
    """A number as a diagnostic shows it: whole if short, else its ends and its length."""
    text = show(v)
    return text if len(text) <= 24 else f"{text[:12]}...{text[-8:]} ({len(text):,} digits)"


def check_kwargs(attrs, specs: dict[str, KwSpec], errors: Collector, what: str, span: Span,
                 key_spans: tuple[tuple[str, Span], ...] = ()) -> tuple:
    """Check keyword options against their specs; return them sorted with defaults filled in.

    ``key_spans`` gives where each option's name was written: an unknown option is
    reported there (its value is not what is wrong).
    """
    given = dict(attrs)
    names = dict(key_spans)
    out = {}
    for key, value in given.items():
        kspec = specs.get(key)
        vspan = getattr(value, "span", None) or span
        if kspec is None:
            errors.error("E206", f"{what} has no option `{key}`", names.get(key, vspan),
                         did_you_mean(key, specs) or (f"options: {', '.join(sorted(specs))}" if specs
                                                      else f"{what} takes no options"))
            continue
        out[key] = _check_value(key, value, kspec, errors, what, vspan)
        needed = given.get(kspec.requires) if kspec.requires else True
        if needed is None or (isinstance(needed, Const) and needed.value in ("", None)):
            errors.error("E221", f"option `{key}` of {what} needs option `{kspec.requires}`", names.get(key, vspan),
                         f"give `{kspec.requires}` too" + (f" ({specs[kspec.requires].doc})"
                                                           if specs[kspec.requires].doc else "")
                         + f", or drop `{key}`")
    for key, kspec in specs.items():
        if key in out or key in given:
            continue
        if kspec.required:
            errors.error("E210", f"{what} needs option `{key}` ({kspec.type})", span,
                         f"add `{key} = {suggest(kspec)}`" + (f" ({kspec.doc})" if kspec.doc else ""))
            continue
        if kspec.default is not None:
            out[key] = _default_value(kspec, span)
    return tuple(sorted(out.items()))


def _default_value(kspec: KwSpec, span) -> Value:
    d = kspec.default
    if kspec.type == "config":
        return Config(str(d), _config_defaults(CONFIG_TABLES[kspec.config][str(d)]), span)
    if isinstance(d, list):
        return tuple(Const(x, _py_kind(x), span) for x in d)
    return Const(d, kspec.type if kspec.type in ("int", "float", "str", "bool", "size") else _py_kind(d), span)


def _config_defaults(cspec) -> tuple:
    return tuple(sorted((k, _default_value(s, None)) for k, s in cspec.params if s.default is not None))


def _py_kind(x) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(x), "str")


def _check_value(key: str, value: Value, kspec: KwSpec, errors: Collector, what: str, span) -> Value:
    if isinstance(value, Symbol):
        return value  # a scalar parameter without a value (a library flow checked on its own)
    if isinstance(value, Ref):
        # In a flow, names are resolved before options are checked (an unknown one stops
        # compilation first), so a name here is a bare word where a constant belongs, e.g.
        # `gpu = H100` in a schedule.
        errors.error("E207", f"option `{key}` of {what} must be {_article(kspec.type)} {_type_word(kspec.type)}, "
                             f"got the name `{value.target}`", value.span,
                     f"strings are in double quotes: `{key} = \"{value.target}\"`" if kspec.type == "str"
                     else f"e.g. `{key} = {suggest(kspec)}`")
        return value
    t = kspec.type
    if t == "any":
        return value
    if t == "config":
        return _check_config(key, value, kspec, errors, what, span)
    if t == "list":
        if not isinstance(value, tuple):
            errors.error("E207", f"option `{key}` of {what} must be a list", span, f"e.g. `{key} = [...]`")
        return value
    if not isinstance(value, Const):
        errors.error("E207", f"option `{key}` of {what} must be {_article(t)} {t}", span,
                     f"e.g. `{key} = {_example(t)}`")
        return value
    ok = value.kind == t or (t == "float" and value.kind == "int") or (t == "size" and value.kind == "int")
    if not ok:
        errors.error("E207", f"option `{key}` of {what} must be {_article(t)} {t}, got "
                             f"{value.text or show(value.value)} ({value.kind})", span,
                     f"e.g. `{key} = {_example(t)}`")
        return value
    if t == "float" and value.kind == "int":
        value = Const(float(value.value), "float", value.span)
    v = value.value
    if t in PLANNED and not isinstance(v, bool) and not abs(v) <= PLANNED[t]:
        errors.error("E222", f"option `{key}` of {what} is {short(v)}, beyond what flowrl plans "
                             f"(at most {PLANNED_SHOWN[t]})", span,
                     "check the number for a typo (an extra digit or exponent); " + _range_hint(key, kspec))
        return value  # the checks below would only say the same again
    if kspec.min is not None and v < kspec.min:
        errors.error("E208", f"option `{key}` of {what} must be >= {_num(kspec.min)}, got {show(v)}", span,
                     _range_hint(key, kspec))
    if kspec.max is not None and v > kspec.max:
        errors.error("E208", f"option `{key}` of {what} must be <= {_num(kspec.max)}, got {show(v)}", span,
                     _range_hint(key, kspec))
    if kspec.choices and v not in kspec.choices:
        errors.error("E209", f"option `{key}` of {what} must be one of {', '.join(map(show, kspec.choices))}, "
                             f"got {show(v)}", span, _choice_hint(key, str(v), kspec))
    return value


_CONFIG_WORDS = {"loss": ("loss", "losses", "ppo_clip(0.2)"), "adapter": ("adapter", "adapters", "lora(r = 16)")}
"""Each configuration table: what one of its values is called, and many, and an example."""


def _check_config(key: str, value: Value, kspec: KwSpec, errors: Collector, what: str, span) -> Value:
    """A configuration value (``ppo_clip(0.2)``, ``lora(r = 16)``) of the table ``kspec.config`` names:
    its name known, its options checked against its record, positional values named."""
    table = CONFIG_TABLES[kspec.config]
    word, words, example = _CONFIG_WORDS[kspec.config]
    listing = f"{words}: {', '.join(sorted(table))}"
    if isinstance(value, Const) and value.kind == "str":
        if value.value not in table:
            errors.error("E211", f"unknown {word} {show(value.value)}", span,
                         did_you_mean(value.value, table) or listing)
            return value
        value = Config(value.value, (), value.span)
    if not isinstance(value, Config):
        errors.error("E207", f"option `{key}` of {what} must be {_article(word)} {word} such as {example}", span,
                     listing)
        return value
    cspec = table.get(value.name)
    if cspec is None:
        errors.error("E211", f"unknown {word} `{value.name}`", value.span, did_you_mean(value.name, table) or listing)
        return value
    names = [k for k, _ in cspec.params]
    opts = dict(value.options)
    if len(value.args) > len(names):
        errors.error("E201", f"`{value.name}` takes at most {len(names)} positional arguments",
                     getattr(value.args[len(names)], "span", value.span), f"options: {', '.join(names)}")
    for k, v in zip(names, value.args):
        if k in opts:
            errors.error("E212", f"option `{k}` of `{value.name}` given twice", getattr(v, "span", value.span),
                         f"`{value.name}`'s positional arguments are, in order: {', '.join(names)}")
        opts[k] = v
    checked = check_kwargs(tuple(sorted(opts.items())), dict(cspec.params), errors, f"`{value.name}`", value.span)
    return Config(value.name, checked, value.span)


def suggest(kspec: KwSpec) -> str:
    """A value of the option that passes its checks, as written in a flow: the default,
    else the first choice, else an example of its type moved into its range."""
    if kspec.default is not None and _in_range(kspec.default, kspec):
        return show(kspec.default)
    if kspec.choices:
        return show(kspec.choices[0])
    if kspec.type in ("int", "float"):
        x = 8 if kspec.type == "int" else 1.0
        if kspec.max is not None and x > kspec.max:
            x = kspec.max
        if kspec.min is not None and x < kspec.min:
            x = kspec.min
        return _num(x) if kspec.type == "int" else repr(float(x))
    return _example(kspec.type)


def _in_range(v, kspec: KwSpec) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return not kspec.choices or v in kspec.choices
    return (kspec.min is None or v >= kspec.min) and (kspec.max is None or v <= kspec.max)


def _range_hint(key: str, kspec: KwSpec) -> str:
    bounds = ([f">= {_num(kspec.min)}"] if kspec.min is not None else []) + \
        ([f"<= {_num(kspec.max)}"] if kspec.max is not None else [])
    what = f"{kspec.doc}: " if kspec.doc else ""
    default = " (the default)" if kspec.default is not None and _in_range(kspec.default, kspec) else ""
    return f"{what}write a value {' and '.join(bounds)}, e.g. `{key} = {suggest(kspec)}`{default}"


def _choice_hint(key: str, given: str, kspec: KwSpec) -> str:
    same_case = [c for c in kspec.choices if c.lower() == given.lower()]
    if same_case:
        return f"names are case-sensitive: write `{key} = {show(same_case[0])}`"
    close = difflib.get_close_matches(given, list(kspec.choices), n=1, cutoff=0.6)
    if close:
        return f"did you mean `{key} = {show(close[0])}`?"
    return (f"{kspec.doc}; " if kspec.doc else "") + f"e.g. `{key} = {suggest(kspec)}`"


def _type_word(t: str) -> str:
    return {"str": "string", "config": "loss such as ppo_clip(0.2)"}.get(t, t)


def _article(t: str) -> str:
    return "an" if t[0] in "aeiou" else "a"


def _example(t: str) -> str:
    return {"int": "8", "float": "1.0", "str": "\"...\"", "bool": "true", "size": "512MB"}.get(t, "...")


def show(v) -> str:
    """A value as it is written in a flow."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, str):
        return f"\"{v}\""
    return str(v)


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
