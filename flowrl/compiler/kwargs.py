"""Checking keyword options (of ops, losses, engines, protocols) against ``KwSpec`` tables."""

from __future__ import annotations

from flowrl.diagnostics import Collector, Span, did_you_mean
from flowrl.ir.graph import Config, Const, Ref, Symbol, Value
from flowrl.catalog.ops import LOSSES, KwSpec


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
    for key, kspec in specs.items():
        if key in out or key in given:
            continue
        if kspec.required:
            errors.error("E210", f"{what} needs option `{key}` ({kspec.type})", span,
                         f"add `{key} = ...`" + (f": {kspec.doc}" if kspec.doc else ""))
            continue
        if kspec.default is not None:
            out[key] = _default_value(kspec, span)
    return tuple(sorted(out.items()))


def _default_value(kspec: KwSpec, span) -> Value:
    d = kspec.default
    if kspec.type == "config":
        return Config(str(d), _config_defaults(LOSSES[str(d)]), span)
    if isinstance(d, list):
        return tuple(Const(x, _py_kind(x), span) for x in d)
    return Const(d, kspec.type if kspec.type in ("int", "float", "str", "bool", "size") else _py_kind(d), span)


def _config_defaults(cspec) -> tuple:
    return tuple(sorted((k, _default_value(s, None)) for k, s in cspec.params if s.default is not None))


def _py_kind(x) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(x), "str")


def _check_value(key: str, value: Value, kspec: KwSpec, errors: Collector, what: str, span) -> Value:
    if isinstance(value, (Symbol, Ref)):
        return value  # abstract parameter / unresolved (already reported)
    t = kspec.type
    if t == "any":
        return value
    if t == "config":
        if isinstance(value, Const) and value.kind == "str":
            if value.value not in LOSSES:
                errors.error("E211", f"unknown loss {show(value.value)}", span,
                             did_you_mean(value.value, LOSSES) or f"losses: {', '.join(sorted(LOSSES))}")
                return value
            value = Config(value.value, (), value.span)
        if not isinstance(value, Config):
            errors.error("E207", f"option `{key}` of {what} must be a loss such as ppo_clip(0.2)", span,
                         f"losses: {', '.join(sorted(LOSSES))}")
            return value
        cspec = LOSSES.get(value.name)
        if cspec is None:
            errors.error("E211", f"unknown loss `{value.name}`", value.span,
                         did_you_mean(value.name, LOSSES) or f"losses: {', '.join(sorted(LOSSES))}")
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
    if kspec.min is not None and v < kspec.min:
        errors.error("E208", f"option `{key}` of {what} must be >= {_num(kspec.min)}, got {show(v)}", span,
                     kspec.doc or None)
    if kspec.max is not None and v > kspec.max:
        errors.error("E208", f"option `{key}` of {what} must be <= {_num(kspec.max)}, got {show(v)}", span,
                     kspec.doc or None)
    if kspec.choices and v not in kspec.choices:
        errors.error("E209", f"option `{key}` of {what} must be one of {', '.join(map(show, kspec.choices))}, "
                             f"got {show(v)}", span,
                     did_you_mean(str(v), kspec.choices) or None)
    return value


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
