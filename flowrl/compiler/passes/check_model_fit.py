"""Check each model fits the engines the schedule gives it: architecture and sequence length.

Requires: plan_layouts (every engine of the flow has its kind and options in ``graph.sched``),
check_resources (the files read here exist and parse).

Guarantees, for each model whose facts are known (``config.json``, preset or ``tiny``):

* a ``tiny(...)`` model's options make a model the builder builds and vLLM serves, by the
  rules :func:`~flowrl.catalog.models.tiny_problems` states once for both (the builder raises
  the same reasons): ``hidden`` divides by ``heads``, ``heads`` by ``kv_heads`` (families with
  grouped-query attention), a head size vLLM's CPU attention has kernels for
  (:data:`~flowrl.catalog.models.CPU_HEAD_SIZES`), a task charset the family's tokenizer keeps
  (E611, at the option as written);
* its architecture (``config.json``'s ``architectures``) is one every engine it runs on runs
  (:attr:`~flowrl.catalog.engines.EngineSpec.architectures`, from the records of
  :mod:`flowrl.catalog.architectures`), and an engine that converts weights by family can take
  this checkpoint's variant of it (RoPE scaling, sliding window: ``ModelFacts.unconvertible``) (E607);
* a model whose output layer is its word embedding (``tie_word_embeddings``: every small Qwen2.5 and
  Llama-3.2) is split by a train engine that computes that layer only over the axes its record allows
  (:attr:`~flowrl.catalog.engines.EngineSpec.untied_axes`: Megatron, pp = 1) (E621);
* a model declared with a 16-bit ``dtype`` and a ``precision`` trains on engines that run that
  precision (:attr:`~flowrl.catalog.engines.EngineSpec.precisions`: Megatron keeps fp32 main params,
  its gradient clipping asserting fp32 gradients, so it has no ``pure``) (E616, at the option);
* a rollout engine's context option (``max_model_len``) does not exceed the model's maximum
  positions, whatever the config calls them (``n_positions`` for GPT-2): vLLM refuses such an
  engine at start-up (E608);
* every ``generate`` fits: its prompt plus ``max_tokens`` fits the rollout engine's context
  (the option as written, else what the runtime gives it:
  :func:`~flowrl.catalog.models.default_context` of the maximum positions). The prompt is
  counted in the first row of each dataset file feeding it (train and ``eval`` splits) with
  the model's tokenizer where that is cheap (:func:`~flowrl.compiler.model_info.prompt_counter`),
  else taken as one token: a lower bound, so what is refused would fail (E609).

The graph is returned unchanged.

>>> from flowrl.compiler.pipeline import compile_text
>>> from flowrl.diagnostics import FlowError
>>> try:
...     compile_text('''
... model m = tiny()
... flow main(d: dataset) { b = sample(d)  r = generate(m, b, max_tokens = 200)  return r }''', "doc.flow")
... except FlowError as e:
...     print(str(e).splitlines()[0])
doc.flow:3:72: error[E609]: `max_tokens = 200` and the prompt (at least 1 token) exceed the 128-token context of `m`'s rollout engine `vllm` (the checkpoint's maximum positions, max_position_embeddings = 128)
"""

from __future__ import annotations

from flowrl.catalog.architectures import ARCHITECTURES
from flowrl.catalog.engines import ENGINES, EngineSpec
from flowrl.catalog.models import ModelFacts, default_context, tiny_problems
from flowrl.catalog.precision import DTYPE_BYTES
from flowrl.catalog.ops import OPS, FactsFrom, OpKind
from flowrl.compiler.context import CompileContext
from flowrl.compiler.model_info import checkpoint_dir, prompt_counter
from flowrl.compiler.resources import checked, first_prompts, prompt_datasets
from flowrl.compiler.sched import model_of, role_of
from flowrl.compiler.schedule.layouts import refusing_engine, runs_on, tied_axis
from flowrl.diagnostics import Collector, Span
from flowrl.ir.graph import Const, FlowGraph, Node, Ref, plain


def check_model_fit(graph: FlowGraph, ctx: CompileContext) -> FlowGraph:
    errors = Collector(ctx.sources)
    for node in graph.nodes():
        if node.kind == OpKind.MODEL and OPS.get(node.op) and OPS[node.op].facts_from == FactsFrom.OPTIONS:
            _check_tiny(node, errors)
    st = graph.sched
    if st is None:
        errors.raise_if_any()
        return graph
    reported: set = set()
    # Engines with a layout written first: a frozen model following its base's trainer shares
    # the base's mistake, reported once where the layout was written.
    for key, eng in sorted(st.engines.items(), key=lambda kv: kv[0] not in st.spec.layouts):
        facts = st.facts.get(model_of(key))
        if facts is None or model_of(key) not in graph:
            continue
        _check_architecture(graph, key, eng.kind, facts, st, errors, reported)
        _check_tied(graph, key, eng, facts, st, errors, reported)
        if role_of(key) == "train":
            _check_precision(graph, key, eng, st, errors, reported)
        if role_of(key) == "rollout":
            _check_context_option(graph, key, eng, facts, st, errors)
    for node in graph.nodes():
        if node.kind == OpKind.GENERATE and node.model:
            _check_lengths(graph, ctx, node, st, errors)
    errors.raise_if_any()
    return graph


def _check_tiny(node: Node, errors: Collector) -> None:
    attrs = {k: plain(v) for k, v in node.attrs}
    if not all(isinstance(v, (int, str)) for v in attrs.values()):
        return  # an option given by a symbol: the shape is not known here
    for problem in tiny_problems(attrs):
        written = [o for o in problem.options if node.key_span(o) is not None]
        span = node.attr(written[0]).span if written else node.span
        errors.error("E611", f"`{node.id}` = {node.op}(...) cannot be built: {problem.reason}", span, problem.fix)


def _layout_span(graph: FlowGraph, key: str, st) -> Span:
    """Where the engine's layout was written, else where its model was declared."""
    layout = st.spec.layouts.get(key)
    return layout.span if layout is not None else graph.node(model_of(key)).span


def _config_words(graph: FlowGraph, model: str, facts: ModelFacts) -> str:
    folder = checkpoint_dir(graph, model)
    return f"{folder / 'config.json'}" if folder is not None else facts.name


def _check_architecture(graph: FlowGraph, key: str, kind: str, facts: ModelFacts, st, errors: Collector,
                        reported: set) -> None:
    arch = facts.architecture
    spec = ENGINES.get(kind)
    if not arch or spec is None:
        return
    # A single-rank engine with more ranks runs on its multi_rank_as engine's (torch(dp = 2) on fsdp's).
    world = getattr(st.engines.get(key), "world_size", 1)
    engines = runs_on(kind, world)
    refusing = refusing_engine(kind, arch, world)
    if refusing is None and facts.unconvertible:
        _check_conversion(graph, key, kind, facts, engines, st, errors, reported)
    if refusing is None or (arch, refusing.name) in reported:
        return
    reported.add((arch, refusing.name))
    model = model_of(key)
    others = [e.name for e in ENGINES.values() if e.serves == spec.serves and _runs(e, arch)
              and e.support(st.hw.platform).ok]
    via = f" (`{kind}` runs on `{refusing.name}`'s ranks)" if refusing is not spec else ""
    moe = (f" (a mixture of {facts.experts} experts; `{refusing.name}` takes no MoE architecture)"
           if facts.experts and not any(ARCHITECTURES[a].moe for a in refusing.architectures if a in ARCHITECTURES)
           else "")
    errors.error("E607", f"`{model}` is a {arch} ({_config_words(graph, model, facts)}), which `{refusing.name}` "
                         f"does not run{via}{moe}; `{refusing.name}` runs {', '.join(sorted(refusing.architectures))}",
                 _layout_span(graph, key, st),
                 (f"give `{key}` an engine that runs {arch}: " + ", ".join(f"`{o}(...)`" for o in others))
                 if others else f"no {spec.serves} engine runs {arch}: use a model of a supported architecture")


def _check_conversion(graph: FlowGraph, key: str, kind: str, facts: ModelFacts, runs_on: list, st,
                      errors: Collector, reported: set) -> None:
    """An engine that converts weights by family runs the architecture, but not this checkpoint's
    variant of it (:attr:`~flowrl.catalog.models.ModelFacts.unconvertible`)."""
    converting = next((e for e in runs_on if e.converts_weights), None)
    if converting is None or (facts.name, converting.name) in reported:
        return
    reported.add((facts.name, converting.name))
    model = model_of(key)
    others = [e.name for e in ENGINES.values() if e.serves == converting.serves and not e.converts_weights
              and _runs(e, facts.architecture) and e.support(st.hw.platform).ok]
    errors.error("E607", f"`{model}` ({_config_words(graph, model, facts)}) is a {facts.architecture} that "
                         f"`{converting.name}` cannot convert: {facts.unconvertible}",
                 _layout_span(graph, key, st),
                 f"give `{key}` an engine that runs the checkpoint with transformers' code: "
                 + ", ".join(f"`{o}(...)`" for o in others))


def _check_precision(graph: FlowGraph, key: str, eng, st, errors: Collector, reported: set) -> None:
    """E616: a 16-bit model's written ``precision`` on a train engine whose record does not run it."""
    node = graph.node(model_of(key))
    precision, dtype = plain(node.attr("precision")), plain(node.attr("dtype"))
    if node.key_span("precision") is None or DTYPE_BYTES.get(dtype, 4) >= 4:
        return  # the default (mixed) runs everywhere; a float32 model trains in float32 whatever it says
    for spec in runs_on(eng.kind, eng.world_size):
        if spec.precisions is None or precision in spec.precisions or (node.id, spec.name) in reported:
            continue
        reported.add((node.id, spec.name))
        able = [e.name for e in ENGINES.values() if e.serves == "train" and (e.precisions is None or precision in
                                                                              e.precisions)]
        errors.error("E616", f"`{node.id}` trains with precision = \"{precision}\", which its train engine "
                             f"`{spec.name}` does not run (it runs {', '.join(spec.precisions)})",
                     node.attr("precision").span,
                     "drop `precision` (mixed: fp32 master weights and Adam moments, bf16 compute), or give "
                     f"`{key}` " + " or ".join(f"`{e}(...)`" for e in able))


def _check_tied(graph: FlowGraph, key: str, eng, facts: ModelFacts, st, errors: Collector, reported: set) -> None:
    """E621: a model whose output layer is its word embedding, on a train engine that computes that layer
    (not a critic's value head nor a served reward model's score head), split over an axis the engine's
    record keeps whole for tied embeddings (:attr:`~flowrl.catalog.engines.EngineSpec.untied_axes`); once per
    checkpoint and layout (a frozen reference following its base's layout shares its base's mistake)."""
    axis = tied_axis(eng, facts)
    if axis is None or not _computes_lm_head(graph, model_of(key)):
        return
    if ("tied", facts.name, eng.kind, axis, getattr(eng, axis)) in reported:
        return
    reported.add(("tied", facts.name, eng.kind, axis, getattr(eng, axis)))
    model = model_of(key)
    others = [e.name for e in ENGINES.values() if e.serves == "train" and not e.untied_axes
              and _runs(e, facts.architecture) and e.support(st.hw.platform).ok]
    errors.error("E621", f"`{model}` ({_config_words(graph, model, facts)}) ties its output layer to its word "
                         f"embedding (tie_word_embeddings), and `{eng.kind}` with {axis} = {getattr(eng, axis)} "
                         f"would hold them on different stages: `{eng.kind}` runs tied embeddings with {axis} = 1 only",
                 _layout_span(graph, key, st),
                 f"give `{key}` {axis} = 1 (the other axes split it)"
                 + (f", or an engine that keeps the tie: {', '.join(f'`{o}(...)`' for o in others)}" if others else ""))


def _computes_lm_head(graph: FlowGraph, model: str) -> bool:
    """Whether ``model``'s train engine computes the language-model head: an actor or a reference does; a
    critic (its value head) and a model served as a scorer on its train engine (``reward_model(m)``) do not."""
    node = graph.node(model)
    if OPS[node.op].role == "critic":
        return False
    return not any(OPS[n.op].serves_model and OPS[n.op].serves_engine == "train" and n.args
                   and isinstance(n.args[0], Ref) and n.args[0].target == model
                   for n in graph.nodes() if n.op in OPS)


def _runs(engine: EngineSpec, arch: str) -> bool:
    return engine.architectures is None or arch in engine.architectures


def _check_context_option(graph: FlowGraph, key: str, eng, facts: ModelFacts, st, errors: Collector) -> None:
    option = ENGINES[eng.kind].context_option if eng.kind in ENGINES else None
    written = eng.options.get(option) if option else None
    if not isinstance(written, int) or not facts.positions_key or written <= facts.max_len:
        return
    model = model_of(key)
    errors.error("E608", f"`{option} = {written}` exceeds `{model}`'s maximum positions: "
                         f"{facts.positions_key} = {facts.max_len} in {_config_words(graph, model, facts)}",
                 _layout_span(graph, key, st),
                 f"`{eng.kind}` refuses a longer context at start-up: write `{option} = {facts.max_len}` or less")


def _context(eng, facts: ModelFacts) -> tuple[int, str] | None:
    """The rollout engine's context in tokens and where the number comes from, or None if unknown."""
    option = ENGINES[eng.kind].context_option if eng.kind in ENGINES else None
    written = eng.options.get(option) if option else None
    if isinstance(written, int):
        return written, f"`{option} = {written}`"
    if not facts.positions_key:
        return None  # the config names no maximum positions: nothing to check against
    where = f"{facts.positions_key} = {facts.max_len}"
    if option is None:
        return facts.max_len, f"the model's maximum positions, {where}"
    context = default_context(facts.max_len)
    return context, (f"the checkpoint's maximum positions, {where}" if context == facts.max_len
                     else f"at most {context} when `{option}` is not set; the checkpoint's {where}")


def _check_lengths(graph: FlowGraph, ctx: CompileContext, node: Node, st, errors: Collector) -> None:
    model = node.model
    eng = st.engines.get(f"{model}.rollout")
    facts = st.facts.get(model)
    max_tokens = node.attr("max_tokens")
    if eng is None or facts is None or not isinstance(max_tokens, Const) or not isinstance(max_tokens.value, int):
        return
    found = _context(eng, facts)
    if found is None:
        return
    context, why = found
    prompt, source = 1, "at least 1 token"
    count = prompt_counter(graph, model)
    if count is not None:
        for dataset in prompt_datasets(graph, node):
            if not checked(dataset, ctx):
                continue
            for f, text in first_prompts(dataset):
                n = count(text)
                if n > prompt:
                    prompt, source = n, f"{n} tokens in the first row of `{f.written}`"
    if prompt + max_tokens.value <= context:
        return
    room = context - prompt
    errors.error("E609", f"`max_tokens = {max_tokens.value}` and the prompt ({source}) exceed the {context}-token "
                         f"context of `{model}`'s rollout engine `{eng.kind}` ({why})", max_tokens.span,
                 (f"lower `max_tokens` to {room} or less" if room >= 1 else "shorten the prompts")
                 + _raise_hint(eng, facts, context))


def _raise_hint(eng, facts: ModelFacts, context: int) -> str:
    option = ENGINES[eng.kind].context_option if eng.kind in ENGINES else None
    if option and facts.positions_key and context < facts.max_len:
        return f", or raise `{option}` (up to {facts.max_len}) in the schedule"
    return ""


__all__ = ["check_model_fit"]
