"""The closed set of op kinds and the catalogue of built-in ops (and losses: :mod:`.losses`).

An op declares what it reads (positional arguments, each a resource or a data value
with the *fields* it needs), its keyword options (type and default) and the fields it
produces. The compiler checks flows against this table; it is data, not code, so the
compiler never needs an engine to know what an op does.

Fields are the columns of the step's experience table (one row per sample): every key a
step value carries is one of :data:`FIELDS` (the runtime checks it), and so is every field
an op needs or produces (``tests/catalog`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from flowrl.catalog.adapters import ADAPTERS
from flowrl.catalog.architectures import TINY_ARCHS
from flowrl.catalog.losses import KL_ESTIMATORS, LOSSES
from flowrl.catalog.platforms import PLATFORMS
from flowrl.catalog.precision import DEFAULT_PRECISION, DTYPE_BYTES, PRECISIONS
from flowrl.catalog.spec import RUNS, ArgSpec, KwSpec, Support
from flowrl.tasks import TASKS


FIELDS: dict[str, str] = {
    "prompt_ids": "prompt token ids [B, P] int",
    "prompt_text": "the prompt as the dataset wrote it [B] str",
    "answers": "ground-truth answers from the dataset [B] str",
    "response_ids": "generated token ids [B, R] int",
    "response_mask": "1 on response tokens [B, T] float",
    "rollout_logprobs": "the sampler's per-token log-probs [B, T] float",
    "group_ids": "which prompt a completion answers [B] int",
    "version": "policy version that generated the sample [B] int",
    "rewards": "scalar reward per sample [B] float",
    "token_rewards": "reward per token (KL-shaped) [B, T] float",
    "logprobs": "per-token log-probs under a model [B, T] float",
    "entropy": "per-token entropy, nats [B, T] float",
    "values": "per-token critic values [B, T] float",
    "advantages": "per-token (or per-sample) advantages [B, T] or [B] float",
    "returns": "per-token returns (critic targets) [B, T] float",
    "done": "the episode ended (agentic flows) [B] bool",
    "observations": "tool/environment output tokens [B, O] int",
    "truncated": "the episode hit the context limit before it was done (agentic flows) [B] bool",
    "rows": "the dataset row each sample came from, every field (rewards and environments read it) [B] dict",
    "routed_experts": "a mixture of experts' routes: the experts the rollout engine sent each token to, per MoE "
                      "layer [B, T, L, k] int (-1: none); carried when an op replays them (routing = \"replay\")",
}
"""Every field of the step's experience table -> what it holds and its shape (B samples,
P prompt tokens, R response tokens, T = the padded prompt + response width). Ops' ``needs`` and
``produces`` name these; the runtime refuses a step value with a key outside this table."""


IS_LEVELS = ("token", "sequence", "geometric")
"""Where off-policy corrections take the importance ratio (``update(is_level = ...)``): per
token; per sequence, the product of its tokens' ratios; ``geometric``, their geometric mean."""

LR_SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate decays after the warm-up (``update(lr_schedule = ...)``)."""

BAD_ROW_POLICIES = ("error", "skip")
"""``jsonl(..., bad_rows = ...)`` / ``parquet``: a row with an empty prompt, a missing field, bytes
that are not UTF-8 or a prompt too long for the rollout engine's context. ``error``: refused,
naming the file and row; ``skip``: left out, and counted (``data/rows_skipped``, events.log)."""

STREAM_MODES = ("auto", "on", "off")
"""``jsonl(..., stream = ...)`` and the other file datasets: read the training split in blocks as the run
goes (``on``), whole before it starts (``off``), or whole unless its files pass 256 MiB (``auto``)."""

ROUTES = "routed_experts"
"""The field of a mixture of experts' routes (:data:`FIELDS`): a replaying op's rollouts carry it, the
runtime's token batches hold it as ``extras["routed_experts"]``."""

ROUTING_MODES = ("native", "replay")
"""``logprobs(routing = ...)`` / ``update(routing = ...)``, for a mixture of experts: ``native``, the
train engine's own router picks each token's experts; ``replay`` (routing replay, R3), the experts the
rollout engine picked when it sampled the rollouts (which then carry ``routed_experts``)."""

_ROUTING = KwSpec("str", "native", choices=ROUTING_MODES,
                  doc="a mixture of experts' routing in the train engine's forward: `native` (its own "
                      "router's top-k) or `replay` (the experts the rollout engine routed each token to; R3)")
"""The one ``routing`` option of the train-engine ops that read a policy's rollouts."""

NAN_POLICIES = ("skip", "stop")
"""``update(on_nan = ...)``: what a non-finite loss or gradient does. ``skip``: the optimizer step
is not taken (AdamW's moments stay clean) and ``faults/nan_skipped`` counts it; ``stop``: the run
stops naming the update op and the step (:mod:`flowrl.runtime.nonfinite`)."""


class OpKind(str, Enum):
    """What a graph node is. Resources are read by ops; the rest are the step's ops."""

    # resources
    MODEL = "model"          # weights: hf(...), tiny(...), frozen(m), critic(m), or a flow parameter
    DATASET = "dataset"      # jsonl(...), parquet(...), hf_dataset(...), mix(...)
    REWARD_FN = "reward_fn"  # verifier(...), python_reward(...), reward_model(m)
    ENV = "env"              # python_env(...): a tool/environment for multi-turn flows
    # step ops
    SAMPLE = "sample"        # draw a batch of prompts
    GENERATE = "generate"    # rollout engine: sample completions
    SCORE = "score"          # reward function on completions
    FILTER = "filter"        # keep some groups of completions, drawing more to fill the batch
    LOGPROBS = "logprobs"    # train engine forward: per-token log-probs (and entropy)
    VALUES = "values"        # critic forward: per-token values
    ADVANTAGE = "advantage"  # driver-side math: advantages, returns, reward shaping
    UPDATE = "update"        # train engine: loss, backward, optimizer step
    RESYNC = "resync"        # weights from the trainer to the rollout engine (compiler-inserted)
    ENV_STEP = "env_step"    # environment / tool step in a multi-turn loop
    USER_CALL = "user_call"  # a user's Python function on data
    CALL = "call"            # an unresolved call of a flow; gone after resolve_names


RESOURCE_KINDS = frozenset({OpKind.MODEL, OpKind.DATASET, OpKind.REWARD_FN, OpKind.ENV})
PRODUCER_KINDS = frozenset({OpKind.SAMPLE, OpKind.GENERATE, OpKind.SCORE, OpKind.FILTER})
"""Ops the runtime's producer stage may run ahead of training (when they read only producer ops
and resources): :func:`flowrl.runtime.pipeline.split_stages`, and the simulator's stages."""

# Value types of flow parameters and declarations.
RESOURCE_TYPES = {"model": OpKind.MODEL, "dataset": OpKind.DATASET, "reward": OpKind.REWARD_FN,
                  "env": OpKind.ENV}
SCALAR_TYPES = ("int", "float", "str", "bool", "size", "list")
PARAM_TYPES = tuple(RESOURCE_TYPES) + ("data",) + SCALAR_TYPES


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: OpKind
    args: tuple[ArgSpec, ...]
    kwargs: dict[str, KwSpec] = field(default_factory=dict)
    produces: frozenset[str] = frozenset()
    passthrough: int | None = None
    """Index of a data argument whose fields the result also carries."""
    engine: str | None = None
    """Where it runs: "rollout", "train", "reward", "env", "driver"; None for resources."""
    role: str | None = None
    """MODEL constructors: the role of the model they make."""
    variadic: bool = False
    """Extra positional data arguments are allowed (user calls)."""
    rest: ArgSpec | None = None
    """Any number of further positional arguments after ``args``, each of this spec (the rewards
    of ``weighted_sum`` after its first)."""
    per_argument: str | None = None
    """A list option holding one number per positional argument (``weighted_sum``'s ``weights``):
    the compiler checks its length and its items, and that no argument is given twice (E220)."""
    doc: str = ""
    handler: str | None = None
    """What serves it at run time, by name: a step op's handler in the runtime's ``HANDLERS``
    table; a resource's builder in the runtime's table of its kind (model sources, dataset
    formats, reward kinds, environment kinds). Tests pair every name with the runtime."""
    group_option: str | None = None
    """Ops computed per group of completions: the option giving the group size (the compiler
    checks that groups have more than one member, else every result would be 0)."""
    effect: bool = False
    """Running it changes something beyond its result: weights written, an environment's
    state, a user's code run. Such an op always runs; any other op whose result nothing
    reads is dead code (warned about and removed by ``eliminate_dead_code``)."""
    platforms: dict = field(default_factory=lambda: dict.fromkeys(PLATFORMS, RUNS))
    """Platform (:data:`~flowrl.catalog.platforms.PLATFORMS`) -> :class:`Support`: every platform
    unless the record says otherwise; ``flowrl check`` refuses the op on a platform where it does
    not run (``compiler/passes/check_platform.py``), quoting ``why``."""
    seconds_per_item: float = 0.0
    """Reward functions: CPU seconds to score one completion (the cost model's estimate)."""
    costs_by_name: dict | None = None
    """Reward functions whose first argument names a built-in (``verifier``): name ->
    :class:`VerifierCost`, the cost model's figure for that one instead of ``seconds_per_item``."""
    paths: tuple[str, ...] = ()
    """Resources: the arguments and options naming a local file, resolved against the folder of
    the flow file that declares the resource; ``flowrl check`` checks each exists
    (``compiler/passes/check_resources.py``)."""
    file_format: str | None = None
    """Datasets: how their files are read, a reader of :mod:`flowrl.data.datasets` (``.jsonl``,
    ``.parquet``), whatever a file's name; ``flowrl check`` reads each file's first row (or
    footer) with it."""
    serves_model: str | None = None
    """Resources that run the model in their first argument on an engine of its own: the role that
    engine takes (``reward``: a scalar-head scorer, forward only; ``judge``: a frozen generator).
    The compiler plans and places the model's ``serves_engine`` engine for it
    (``flowrl.compiler.sched.engines_needed``); the runtime starts a train engine in that role."""
    serves_engine: str = "train"
    """Which engine of the model a ``serves_model`` resource runs on: ``train`` (a forward) or
    ``rollout`` (generation; any rollout engine serves, no role of its own)."""
    python_ref: str | None = None
    """Ops naming user code as ``"module:attribute"`` in their first argument: what the attribute
    is (``function``, ``class``). ``flowrl check`` finds the module (the flow file's folder,
    then ``PYTHONPATH``, then installed packages: :mod:`flowrl.pyrefs`) and reads that it
    defines the attribute, without running it."""
    facts_from: str | None = None
    """Models: where their architecture facts come from (:mod:`flowrl.compiler.model_info`):
    ``checkpoint`` (the ``config.json`` of the directory in argument ``path``, else a preset),
    ``options`` (a tiny model's options), ``base`` (the model in the first argument)."""

    redraw: "RedrawSpec | None" = None
    """Ops that keep only some groups of their input and re-run the step's ops before them for
    more prompts until the batch is full (DAPO's dynamic sampling): which options say how many
    groups, how many draws at most, and how many groups a draw is expected to keep (the
    workload model's oversampling, :meth:`RedrawSpec.expected_draws`)."""
    library: str | None = None
    """The procedural library an op needs (``reasoning_gym``), checked through its entry of
    :data:`flowrl.compiler.library_checks.LIBRARY_CHECKS` (the package installed, E672). A dataset it
    generates takes options beyond ``kwargs``, the library's own config: passed through by
    ``check_edge_types`` (constants and lists only), checked against the library by ``check_datasets``
    without generating a split, and lowered as one option, ``config``."""
    row_fields: tuple[str, ...] = ()
    """Rewards: fields of each dataset row they read besides the answer (``reasoning_gym_score``: the
    row's ``metadata``); ``flowrl check`` refuses a dataset file they score whose first rows lack one
    (E622), as it does a verifier's (:attr:`VerifierCost.row_fields`)."""
    protocol: str | None = None
    """Environments: how their episodes meet the policy. None: the ``env_step`` protocol (the runtime
    hands each model turn to the environment); ``openai``: the environment drives the policy itself,
    through the rollout endpoint's OpenAI API (:mod:`flowrl.runtime.endpoint`), in ``agent_rollout``.
    Ops that take an environment say which protocol they need (``check_agents`` pairs them)."""

    def arg_spec(self, i: int) -> ArgSpec | None:
        """The spec of positional argument ``i``: one of ``args``, else ``rest``, else None."""
        return self.args[i] if i < len(self.args) else self.rest

    def support(self, platform: str) -> Support:
        return self.platforms.get(platform, Support(False, {}, f"`{self.name}` does not run on {platform}"))


@dataclass(frozen=True)
class RedrawSpec:
    """The options of an op that draws again until it keeps enough groups (:attr:`OpSpec.redraw`).

    At run time the op re-runs the ops between the step's prompts and itself (``sample``,
    ``generate``, ``score``) with fresh prompts; the compiler's workload model multiplies the
    generation those ops do by :meth:`expected_draws`.
    """

    size: str
    """Option: groups kept per step (0: as many as one draw has)."""
    max_draws: str
    """Option: the most draws per step."""
    keep: str
    """Option: the expected fraction of a draw's groups that are kept."""

    @staticmethod
    def expected_draws(size: int, groups_per_draw: int, max_draws: int, keep: float) -> float:
        """Draws a step is expected to make: enough for ``size`` groups at ``keep`` of each draw's
        ``groups_per_draw``, at least 1 and at most ``max_draws``.

        >>> RedrawSpec.expected_draws(64, 64, 4, 0.4), RedrawSpec.expected_draws(64, 64, 2, 0.1)
        (2.5, 2)
        """
        need = (size or groups_per_draw) / max(groups_per_draw * keep, 1e-9)
        return max(1, min(max_draws, need))


def _a(name, type_, *needs, optional=False, doc=""):
    return ArgSpec(name, type_, frozenset(needs), optional, doc)


_TOKENS = ("prompt_ids", "response_ids", "response_mask")
class FactsFrom(str, Enum):
    """Where a model declaration's facts (shape, positions, architecture) come from
    (:attr:`OpSpec.facts_from`): its base model, its own options, or a checkpoint's ``config.json``."""

    BASE = "base"
    OPTIONS = "options"
    CHECKPOINT = "checkpoint"


_F = frozenset

OPS: dict[str, OpSpec] = {}


def _op(spec: OpSpec) -> None:
    # Every op is served at run time by the entry of its own name, unless it says otherwise.
    OPS[spec.name] = spec if spec.handler else replace(spec, handler=spec.name)


# ---- resources ------------------------------------------------------------------
CONFIG_TABLES = {"loss": LOSSES, "adapter": ADAPTERS}
"""Configuration values by kind (what a ``config`` option's :attr:`KwSpec.config` names): a call of one of
their names in a flow is a value, not an op (``loss = ppo_clip(0.2)``, ``lora = lora(r = 16)``)."""
CONFIG_NAMES = frozenset(LOSSES) | frozenset(ADAPTERS)
"""Every configuration value's name (losses and adapters share one namespace)."""

_LORA = KwSpec("config", None, config="adapter",
               doc="train low-rank adapters, not the weights: lora(r = 16, alpha = 32, targets = [\"q_proj\", "
                   "\"v_proj\"]) (flowrl.catalog.adapters)")
"""The ``lora`` option of the trainable model constructors."""
_DTYPE = KwSpec("str", "float32", choices=tuple(DTYPE_BYTES),
               doc="the dtype the model computes in and its rollout engine serves (flowrl.catalog.precision)")
_PRECISION = KwSpec("str", DEFAULT_PRECISION, choices=tuple(PRECISIONS),
                    doc="with a 16-bit dtype: `mixed` trains fp32 master weights and Adam moments, `pure` the "
                        "dtype's own (flowrl.catalog.precision)")
"""The precision options of the trainable model constructors (``dtype``, ``precision``)."""
_op(OpSpec("hf", OpKind.MODEL, (_a("path", "str"),), role="trainable", facts_from=FactsFrom.CHECKPOINT,
           kwargs={"dtype": _DTYPE, "precision": _PRECISION, "lora": _LORA},
           doc="A transformers checkpoint: a local directory or a hub id."))
_TINY_SHAPE = {
    "hidden": KwSpec("int", 128, min=32),
    "layers": KwSpec("int", 2, min=1), "heads": KwSpec("int", 4, min=1),
    "kv_heads": KwSpec("int", 2, min=1),
    "arch": KwSpec("str", "llama", choices=tuple(TINY_ARCHS),
                   doc="model family (flowrl.catalog.architectures.TINY_ARCHS)"),
}
"""The shape options of the tiny models built locally (``tiny``, ``tiny_rm``)."""
_TASK_SHAPE = {k: KwSpec("int", None, min=spec.min, doc=f"default: the task's own shape (Task.model), else {spec.default}")
               for k, spec in _TINY_SHAPE.items() if k != "arch"}
"""``tiny``'s shape options: unset, the model takes its task's shape (:func:`flowrl.catalog.models.tiny_shape`),
so ``tiny(task = "longtail")`` is the ~12M-parameter model that task needs."""
_op(OpSpec("tiny", OpKind.MODEL, (), role="trainable", facts_from=FactsFrom.OPTIONS,
           kwargs={"task": KwSpec("str", "arith", choices=tuple(TASKS),
                                   doc="a task of flowrl.tasks: its rows, verifier and tokenizer characters"),
                   **_TINY_SHAPE, **_TASK_SHAPE,
                   "warm_start": KwSpec("int", None, min=0, doc="most SFT steps (default: the task's; "
                                        "it stops sooner at its target accuracy; 0: random weights)"),
                   "seed": KwSpec("int", 0, doc="added to the run's `seed`: seeds the init and the SFT data order"),
                   "dtype": _DTYPE, "precision": _PRECISION, "lora": _LORA},
           doc="A tiny model (Llama-style unless `arch` says) built locally for `task` and warm-started by SFT (cached)."))
_op(OpSpec("tiny_rm", OpKind.MODEL, (), role="reward", facts_from=FactsFrom.OPTIONS,
           kwargs={"task": KwSpec("str", "arith", choices=tuple(t for t in TASKS if TASKS[t].sft_turns is None),
                                   doc="a single-turn task of flowrl.tasks: its rows, verifier and tokenizer characters"),
                   **_TINY_SHAPE,
                   "steps": KwSpec("int", 4000, min=1, doc="Bradley-Terry steps on the preference pairs"),
                   "samples": KwSpec("int", 8, min=1, doc="completions of the policy's warm start per train prompt; "
                                     "its wrong ones are the rejected of the pairs"),
                   "base_accuracy": KwSpec("float", 0.8, min=0.0, max=1.0,
                                           doc="the reward model's own warm start runs until this held-out "
                                               "accuracy (a judge must know more than the policy it judges)"),
                   "seed": KwSpec("int", 0, doc="added to the run's `seed`: seeds the init, the warm start, "
                                                "the sampled pairs and the fit")},
           doc="A tiny reward model for `task` built locally (cached): the task's tiny model warm-started "
               "further, fit by Bradley-Terry to prefer each prompt's answer over a policy's wrong samples and "
               "near misses; served by `reward_model(...)` (flowrl.models.reward)."))
_op(OpSpec("frozen", OpKind.MODEL, (_a("model", "model"),), role="frozen", handler="derived", facts_from=FactsFrom.BASE,
           doc="A frozen copy of a model's initial weights (e.g. the KL reference)."))
_op(OpSpec("critic", OpKind.MODEL, (_a("model", "model"),), role="critic", handler="derived", facts_from=FactsFrom.BASE,
           doc="A trainable value model initialised from a model, with a scalar value head."))
@dataclass(frozen=True)
class VerifierCost:
    """What scoring one completion costs a built-in verifier, for the cost model (measured on this CPU)."""

    seconds_per_item: float
    """CPU seconds of one reward worker per completion."""
    integer_seconds_per_item: float | None = None
    """Where every reference answer is an integer: the verifier's fast path (None: no such path)."""
    row_fields: tuple[str, ...] = ()
    """Fields of each dataset row it reads besides the answer (every dataset must have the answer):
    ``flowrl check`` refuses a dataset it scores whose first rows lack one (E622)."""


VERIFIER_COSTS = {
    # math-verify parses both sides (LaTeX, sympy): ~2 ms; integer answers and completions compare as
    # numbers first (flowrl.rewards.verifiers.math_equivalence): 0.6 us measured
    "math": VerifierCost(2e-3, integer_seconds_per_item=1e-6),
    "exact": VerifierCost(1e-6),  # a string comparison: 0.1 us measured
    # one sandboxed process per completion: 56-180 ms measured (bench/sandbox.py); its row's tests
    # (flowrl.rewards.code.TESTS_FIELD)
    "code": VerifierCost(0.1, row_fields=("tests",)),
    "final": VerifierCost(3e-6),  # a regex over the completion: 1.3 us measured
    # the row's Reasoning Gym task scores it (flowrl.rewards.reasoning_gym): its entry generated again
    # (cached) and its `score_answer`; ~20 us measured on chain_sum
    "reasoning_gym": VerifierCost(2e-5, row_fields=("metadata",)),
}
"""The built-in rule verifiers ``verifier(NAME)`` names (served by ``flowrl.rewards.verifiers.VERIFIERS``)
and what each costs per completion."""
VERIFIER_NAMES = tuple(VERIFIER_COSTS)
"""The built-in rule verifiers' names."""

_DATASET_KWARGS = {
    "prompt": KwSpec("str", "prompt"), "answer": KwSpec("str", "answer"),
    "eval": KwSpec("str", "", doc="held-out split, scored greedily during a run"),
    "completion": KwSpec("str", "", doc="the field of a reference completion (a worked solution, what TRL's "
                         "prompt-completion datasets call `completion`): every row must have it, and `flowrl plan` "
                         "expects responses as long as these where it reads them (the first rows of a JSON-lines "
                         "file; without one, as long as the answers where the policy is a tiny model warm-started "
                         "on them; else it assumes a length from `max_tokens`)"),
    "eval_reward": KwSpec("str", None, choices=VERIFIER_NAMES, requires="eval",
                          doc="the rule verifier that scores the held-out split (default: the flow's reward); "
                              "what held-out accuracy means when training reads a reward model or a judge"),
    "chat": KwSpec("bool", None, doc="prompts are chat messages ([{role, content}], a string being one user message) "
                                     "rendered with the model's chat template (flowrl.data.chat); false: raw text; "
                                     "unset: raw text, or, with a `template` or `system`, through the model's chat "
                                     "template when its tokenizer has one"),
    "bad_rows": KwSpec("str", "error", choices=BAD_ROW_POLICIES,
                       doc="rows with an empty prompt, a missing field, non-UTF-8 bytes or a prompt too long for "
                           "the rollout engine: refused naming file and row, or skipped and counted (data/rows_skipped)"),
    "template": KwSpec("str", "", doc="the prompt, written from each row's fields: `{field}` slots (`{{`, `}}`: "
                       "braces), e.g. \"Question: {question}\\nAnswer:\"; then `prompt` names no field"),
    "system": KwSpec("str", "", doc="a system prompt: the first message where prompts go through the chat "
                     "template, else written before the prompt (a blank line between)"),
    "stream": KwSpec("str", "auto", choices=STREAM_MODES,
                     doc="read the training split in blocks while the run goes, never whole (`on`), read it whole "
                         "(`off`), or stream files over 256 MiB (`auto`); flowrl.data.sampler.StreamSampler"),
    "window": KwSpec("int", 64, min=1, doc="streaming: blocks read and shuffled together (a block: 1 MiB of a "
                     "JSON-lines file, a Parquet row group, an Arrow record batch); what the run holds of the data"),
}
"""The options every dataset format takes (one file format per record, the same fields)."""
_op(OpSpec("jsonl", OpKind.DATASET, (_a("path", "str"),), paths=("path", "eval"), file_format=".jsonl",
           kwargs=_DATASET_KWARGS,
           doc="A local JSON-lines dataset with a prompt field and an answer field."))
_op(OpSpec("parquet", OpKind.DATASET, (_a("path", "str"),), paths=("path", "eval"), file_format=".parquet",
           kwargs=_DATASET_KWARGS,
           doc="A local parquet dataset with a prompt column and an answer column."))
_op(OpSpec("hf_dataset", OpKind.DATASET, (_a("path", "str"),),
           kwargs={**_DATASET_KWARGS,
                   "split": KwSpec("str", "train", doc="the split trained on: a split of a `save_to_disk` "
                                   "DatasetDict, or the shards of a folder whose names start with it "
                                   "(`train-00000-of-00004.parquet`, `train/`)"),
                   "eval": KwSpec("str", "", doc="the held-out split's name (a glob of shards where `path` is a "
                                  "glob), scored greedily during a run")},
           doc="A Hugging Face `datasets` directory (`save_to_disk`: a DatasetDict or a Dataset, its Arrow files "
               "read as data), or a folder or glob of Parquet / JSON-lines shards (\"data/train-*.parquet\")."))
_op(OpSpec("mix", OpKind.DATASET, (_a("first", "dataset", doc="a declared dataset"),),
           rest=_a("more", "dataset", doc="further declared datasets"), per_argument="weights",
           kwargs={"weights": KwSpec("list", None, doc="one number >= 0 per dataset, in order: the share of the "
                                     "rows drawn from it (default: equal)")},
           doc="Datasets mixed: each prompt is drawn from one of them with the weights' probabilities "
               "(seeded by the run's seed, resumable); the held-out split is each one's `eval`."))
_op(OpSpec("verifier", OpKind.REWARD_FN, (ArgSpec("name", "str", choices=VERIFIER_NAMES),),
           kwargs={"correct": KwSpec("float", 1.0), "wrong": KwSpec("float", 0.0),
                   "timeout": KwSpec("float", 5.0, min=0.1, max=3600,
                                     doc="seconds one completion's check may take: `code` runs each of its "
                                         "programs under this deadline (in the sandbox), `math` parses and "
                                         "compares under it; past it the completion scores `wrong`")},
           costs_by_name=VERIFIER_COSTS,
           doc="A named rule verifier: \"math\" (math-verify), \"exact\", \"code\" (runs the "
               "completion's program against its dataset row's `tests` in the sandbox), \"final\" (the "
               "digits after the completion's last `=` equal the answer), or \"reasoning_gym\" (the row's "
               "Reasoning Gym task scores it full marks)."))
_op(OpSpec("reasoning_gym", OpKind.DATASET, (ArgSpec("task", "str", doc="a task of the reasoning_gym package"),),
           library="reasoning_gym",
           kwargs={"size": KwSpec("int", 1000, min=1, max=1_000_000, doc="training rows (items 0..size-1 of the "
                                  "task's stream for `seed`), generated when the run starts"),
                   "seed": KwSpec("int", 0, min=0, max=2**31, doc="the generator's seed (the run's `seed` does not "
                                  "change the data)"),
                   "eval_size": KwSpec("int", 0, min=0, max=100_000, doc="held-out rows: the stream continued past "
                                       "the training rows, questions the training split holds left out"),
                   "prompt": KwSpec("str", "question", doc="the row field that is the prompt"),
                   "answer": KwSpec("str", "answer", doc="the row field of the reference answer"),
                   "eval_reward": KwSpec("str", None, choices=VERIFIER_NAMES, requires="eval_size",
                                         doc="the rule verifier that scores the held-out split (default: the flow's "
                                             "reward; `reasoning_gym`: the task's own scorer)"),
                   **{k: _DATASET_KWARGS[k] for k in ("chat", "bad_rows", "template", "system") if k in _DATASET_KWARGS}},
           doc="A Reasoning Gym task's generated rows (`question`, `answer`, `metadata`), offline; options beyond "
               "these are the task's own config (`min_terms = 2`), checked against its config class "
               "(flowrl.data.reasoning_gym)."))
_op(OpSpec("reasoning_gym_score", OpKind.REWARD_FN, (), row_fields=("metadata",), library="reasoning_gym",
           kwargs={"extract": KwSpec("str", "auto", choices=("auto", "tag", "raw"),
                                     doc="the answer read from a completion: `tag`, the last <answer>...</answer> "
                                         "(reasoning_gym's own rule); `raw`, the whole completion; `auto`, the tag "
                                         "where there is one, else the whole completion"),
                   "on_error": KwSpec("float", 0.0, doc="the reward of a sample that cannot be scored (a row "
                                      "without its task), reported in events.log")},
           seconds_per_item=2e-5,
           doc="The score of each completion by its row's Reasoning Gym task (`score_answer`: 1 right, partial "
               "credit for some tasks), as reasoning_gym evaluates; rows of `reasoning_gym(...)` or rows "
               "reasoning_gym wrote (`metadata.source_dataset`)."))
_op(OpSpec("python_reward", OpKind.REWARD_FN, (_a("function", "str"),), python_ref="function",
           kwargs={"workers": KwSpec("int", 2, min=1), "on_error": KwSpec("float", 0.0),
                   "timeout": KwSpec("float", 60.0, min=0.1, max=86400,
                                     doc="seconds the function may take to score one completion; past it the "
                                         "sample scores `on_error`, its worker is replaced, and the error (with "
                                         "what the function printed) is in events.log")},
           seconds_per_item=1e-3,  # a Python call per completion
           doc="A Python reward function given as \"module:function\"."))
_op(OpSpec("reward_model", OpKind.REWARD_FN, (_a("model", "model"),), serves_model="reward",
           seconds_per_item=0.0,  # its forward runs on the model's own engine, costed there (schedule.estimate)
           doc="A served reward model: a one-label sequence classifier (its score at the completion's last "
               "token) on the model's own engine, placed by the schedule (`rm.train`); it scores the "
               "rollouts' token ids, batched."))
_op(OpSpec("llm_judge", OpKind.REWARD_FN, (_a("model", "model", doc="the judge, a frozen model"),),
           serves_model="judge", serves_engine="rollout",
           kwargs={"template": KwSpec("str", "{prompt}{completion}", doc="what the judge reads: `{prompt}` and "
                                      "`{completion}` are replaced (and `{answer}`, the row's answer)"),
                   "max_tokens": KwSpec("int", 8, min=1, doc="the longest judgement, in tokens"),
                   "on_error": KwSpec("float", 0.0, doc="the reward of a judgement with no number in it "
                                      "(counted in reward/errors)")},
           seconds_per_item=0.0,  # its generation runs on the judge's own rollout engine, costed there
           doc="A generative judge: the model's rollout engine reads the template with the prompt and the "
               "completion and writes greedily; the first number it writes is the reward."))
_op(OpSpec("weighted_sum", OpKind.REWARD_FN, (_a("first", "reward", doc="a declared reward"),),
           rest=_a("more", "reward", doc="further declared rewards"),
           kwargs={"weights": KwSpec("list", None, required=True,
                                     doc="one number per reward, in order: the reward is the sum of weight x score")},
           per_argument="weights",
           seconds_per_item=0.0,  # each reward in it is costed (and served) as its own resource
           doc="Rewards combined: the weighted sum of the scores of the declared rewards it names (each "
               "served as it is alone); each one's mean is logged as `reward/part/<name>/mean`."))
ENV_CALLS_PER_WORKER = 64
"""Calls one environment worker (a threaded Ray actor) runs at a time: episodes waiting on a slow
tool do not block the others. A pool without ``workers`` gets one worker per this many episodes in
flight (:mod:`flowrl.compiler.passes.size_env_pools`)."""

_op(OpSpec("python_env", OpKind.ENV, (_a("cls", "str"),), python_ref="class",
           kwargs={"timeout": KwSpec("float", 10.0, min=0, doc="seconds one reset + step call may take; a call "
                                     "past it ends its episode with an error (0: no limit)"),
                   "workers": KwSpec("int", None, min=1, doc="Ray actors hosting the environments; episodes are "
                                     "spread over them and their calls run concurrently (default: sized by the "
                                     "schedule, one per 64 episodes in flight)")},
           doc="An environment / tool class given as \"module:Class\" (protocol: flowrl.envs), in a pool of "
               "Ray actors (flowrl.runtime.env_pool)."))
AGENT_MAX_TURNS = 1000
"""The most model calls ``agent(max_turns = ...)`` allows one episode (each call is one turn of its row)."""
AGENT_MAX_TIMEOUT = 86400.0
"""The longest ``agent(timeout = ...)``, seconds (a day)."""
_op(OpSpec("agent", OpKind.ENV, (_a("function", "str"),), python_ref="function", protocol="openai",
           kwargs={"max_turns": KwSpec("int", 16, min=1, max=AGENT_MAX_TURNS,
                                       doc="model calls one episode may make; a call past it is refused (400)"),
                   "timeout": KwSpec("float", 300.0, min=0, max=AGENT_MAX_TIMEOUT,
                                     doc="seconds one episode (the whole run(client, row)) may take; past it the "
                                     "episode ends with an error (0: no limit)"),
                   "workers": KwSpec("int", None, min=1, doc="Ray actors running the episodes, 64 at a time each "
                                     "(default: sized by the schedule, one per 64 episodes in flight)")},
           doc="An agent program `module:function`, `run(client, row)` (async or not): it talks to the policy "
               "through an OpenAI client pointed at the rollout endpoint, and returns its answer or a reward "
               "(flowrl.runtime.agents)."))
_ENV_POOL = {"timeout": KwSpec("float", 10.0, min=0, doc="seconds one reset + step call may take; a call past it "
                               "ends its episode with an error (0: no limit)"),
             "workers": KwSpec("int", None, min=1, doc="Ray actors hosting the environments (default: sized by the "
                               "schedule, one per 64 episodes in flight)")}
"""The pool options every environment declaration takes (python_env's and the libraries')."""
# Environment libraries (flowrl.catalog.env_libraries): each served by its adapter through the env_step protocol.
_op(OpSpec("textarena", OpKind.ENV, (_a("game", "str", doc="a TextArena environment id, e.g. \"GuessTheNumber-v0\""),),
           handler="library_env",
           kwargs={**_ENV_POOL,
                   "players": KwSpec("int", 1, min=1, doc="players in the game; the model is player 0"),
                   "opponent": KwSpec("str", None, doc="\"module:function\" (observation -> action) playing every "
                                      "other player (needed when players > 1)")},
           doc="A TextArena game, the model as player 0 (flowrl.envs.textarena_games); its first prompt is the "
               "game's first observation for the row's `seed` (rows: `python -m flowrl.envs.textarena_games`)."))
_op(OpSpec("gymnasium", OpKind.ENV, (_a("env_id", "str", doc="a registered id, or \"module:EnvId\""),),
           handler="library_env",
           kwargs={**_ENV_POOL,
                   "max_steps": KwSpec("int", None, min=1, doc="ends an episode after this many steps (truncation)")},
           doc="A Gymnasium environment with text observations; the model's turn is the action (text, or an "
               "integer for a Discrete space) (flowrl.envs.gymnasium_envs)."))
_op(OpSpec("openenv", OpKind.ENV, (_a("cls", "str", doc="\"module:Class\" of an openenv Environment"),),
           python_ref="class", handler="library_env",
           kwargs={**_ENV_POOL,
                   "action": KwSpec("str", None, required=True, doc="\"module:Class\" of the environment's Action"),
                   "field": KwSpec("str", "message", doc="the Action field the model's turn is put in"),
                   "observation": KwSpec("str", "", doc="the Observation field shown to the model (default: its "
                                         "fields other than done, reward and metadata, as JSON)")},
           doc="An OpenEnv environment, in process (flowrl.envs.openenv_envs)."))
_op(OpSpec("verifiers", OpKind.ENV, (_a("taskset", "str", doc="a verifiers taskset: a module exporting its Taskset "
                                        "subclass in `__all__`, or one of verifiers' own"),),
           handler="library_env", kwargs=dict(_ENV_POOL),
           doc="A verifiers taskset (verifiers.v1): each task's prompt, the model's reply scored by the task's own "
               "rewards (flowrl.envs.verifiers_tasks); rows: `python -m flowrl.envs.verifiers_tasks TASKSET`."))
_op(OpSpec("mcp", OpKind.ENV, (_a("command", "str", doc="the command starting an MCP server on stdio, e.g. "
                                  "\"python -m my_server\""),),
           handler="library_env",
           kwargs={**_ENV_POOL,
                   "format": KwSpec("str", "auto", choices=("auto", "hermes", "llama3"),
                                    doc="the tool-call format the model writes (auto: from its chat template)")},
           doc="Tools of an MCP server (stdio): listed into the prompt by the chat template, the model's calls "
               "parsed in the template's format and answered as tool messages; a turn without a call is the "
               "final answer (reward 1 if it equals the row's answer) (flowrl.envs.mcp_tools)."))

# ---- step ops ----------------------------------------------------------------------
_op(OpSpec("sample", OpKind.SAMPLE, (_a("dataset", "dataset"),),
           kwargs={"size": KwSpec("int", 64, min=1, doc="prompts per step")},
           produces=_F({"prompt_ids", "answers"}), engine="driver",
           doc="Draw the step's prompts from a dataset (deterministic, resumable cursor)."))
_op(OpSpec("generate", OpKind.GENERATE, (_a("model", "model"), _a("prompts", "data", "prompt_ids")),
           kwargs={"n": KwSpec("int", 1, min=1, doc="completions per prompt"),
                   "temperature": KwSpec("float", 1.0, min=0.0, doc="sampling temperature; 0 is greedy"),
                   "top_p": KwSpec("float", 1.0, min=0.0, max=1.0),
                   "top_k": KwSpec("int", -1, min=-1),
                   "max_tokens": KwSpec("int", 64, min=1),
                   "stop": KwSpec("list", []),
                   "seed": KwSpec("int", 0)},
           produces=_F({*_TOKENS, "rollout_logprobs", "group_ids", "version"}), passthrough=1,
           engine="rollout", doc="Sample n completions per prompt with the model's rollout engine."))
_op(OpSpec("score", OpKind.SCORE, (_a("reward", "reward"), _a("rollouts", "data", "response_ids")),
           produces=_F({"rewards"}), engine="reward",
           doc="Score completions with a reward function; `r(x)` for a reward `r` means `score(r, x)`."))
_op(OpSpec("logprobs", OpKind.LOGPROBS, (_a("model", "model"), _a("rollouts", "data", *_TOKENS)),
           kwargs={"entropy": KwSpec("bool", False), "routing": _ROUTING},
           produces=_F({"logprobs"}), engine="train",
           doc="Per-token log-probs of the rollouts under a model (train engine forward)."))
_op(OpSpec("values", OpKind.VALUES, (_a("critic", "model"), _a("rollouts", "data", *_TOKENS)),
           produces=_F({"values"}), engine="train", doc="Per-token values from a critic."))
_op(OpSpec("filter_groups", OpKind.FILTER,
           (_a("scores", "data", "rewards"), _a("rollouts", "data", "response_ids", "response_mask", "group_ids")),
           kwargs={"group": KwSpec("int", None, min=2, required=True, doc="completions per prompt (generate's n)"),
                   "size": KwSpec("int", 0, min=0, doc="groups kept per step (0: as many as one draw has)"),
                   "max_draws": KwSpec("int", 4, min=1,
                                       doc="most draws of prompts per step (1: filter without drawing again)"),
                   "expect_keep": KwSpec("float", 0.5, min=0.01, max=1.0,
                                         doc="expected fraction of groups with unequal rewards (the cost "
                                             "model's oversampling; no effect on the run)")},
           produces=_F({"rewards"}), passthrough=1, engine="driver", group_option="group",
           redraw=RedrawSpec(size="size", max_draws="max_draws", keep="expect_keep"),
           doc="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and draw "
               "more prompts (sample, generate, score again) until `size` groups are kept or "
               "`max_draws` draws were made; logs `filter/*` (draws, groups kept)."))
_op(OpSpec("overlong_penalty", OpKind.ADVANTAGE,
           (_a("scores", "data", "rewards"), _a("rollouts", "data", "response_mask")),
           kwargs={"max_tokens": KwSpec("int", None, min=1, required=True,
                                        doc="L_max: the length limit (the generate op's max_tokens)"),
                   "buffer": KwSpec("int", None, min=1, required=True,
                                    doc="L_cache: the penalty ramps from 0 to -factor over the last "
                                        "`buffer` tokens before the limit"),
                   "factor": KwSpec("float", 1.0, min=0.0, doc="penalty scale")},
           produces=_F({"rewards"}), engine="driver",
           doc="DAPO overlong reward shaping: rewards plus a soft length penalty near `max_tokens` (Eq. 13)."))
_op(OpSpec("group_advantage", OpKind.ADVANTAGE, (_a("scores", "data", "rewards"),),
           kwargs={"group": KwSpec("int", None, min=1, required=True),
                   "normalize_std": KwSpec("bool", True), "eps": KwSpec("float", 1e-6, min=0.0)},
           produces=_F({"advantages"}), engine="driver", group_option="group",
           doc="GRPO: (r - mean of the group) / (std of the group + eps); Dr.GRPO without std."))
_op(OpSpec("rloo", OpKind.ADVANTAGE, (_a("scores", "data", "rewards"),),
           kwargs={"group": KwSpec("int", None, min=2, required=True)},
           produces=_F({"advantages"}), engine="driver", group_option="group",
           doc="RLOO: reward minus the mean of the other samples of its group."))
_op(OpSpec("reinforce_pp", OpKind.ADVANTAGE,
           (_a("scores", "data", "rewards"), _a("rollouts", "data", "response_mask")),
           kwargs={"gamma": KwSpec("float", 1.0, min=0.0, max=1.0), "whiten": KwSpec("bool", True)},
           produces=_F({"advantages"}), engine="driver",
           doc="REINFORCE++: discounted returns whitened over the batch."))
_op(OpSpec("reinforce_pp_baseline", OpKind.ADVANTAGE,
           (_a("scores", "data", "rewards"), _a("rollouts", "data", "response_mask")),
           kwargs={"group": KwSpec("int", None, min=2, required=True)},
           produces=_F({"advantages"}), engine="driver", group_option="group",
           doc="REINFORCE++-baseline: reward minus its group's mean, then whitened over the batch's tokens."))
_op(OpSpec("gae", OpKind.ADVANTAGE,
           (_a("scores", "data", "rewards"), _a("values", "data", "values"),
            _a("rollouts", "data", "response_mask")),
           kwargs={"gamma": KwSpec("float", 1.0, min=0.0, max=1.0),
                   "lam": KwSpec("float", 0.95, min=0.0, max=1.0)},
           produces=_F({"advantages", "returns"}), engine="driver",
           doc="Generalised advantage estimation with a critic (PPO)."))
_op(OpSpec("kl_penalty", OpKind.ADVANTAGE,
           (_a("scores", "data", "rewards"), _a("logprobs", "data", "logprobs"),
            _a("ref_logprobs", "data", "logprobs"), _a("rollouts", "data", "response_mask")),
           kwargs={"coef": KwSpec("float", 0.05, min=0.0),
                   "kind": KwSpec("str", "k1", choices=KL_ESTIMATORS)},
           produces=_F({"rewards", "token_rewards"}), engine="driver",
           doc="KL-in-reward: token rewards minus coef * KL(policy || reference)."))
_op(OpSpec("update", OpKind.UPDATE,
           (_a("model", "model"), _a("rollouts", "data", *_TOKENS),
            _a("targets", "data", doc="advantages (policy losses) or returns (value loss)"),
            _a("old", "data", "logprobs", optional=True, doc="old log-probs (or old values for the critic)"),
            _a("ref_logprobs", "data", "logprobs", optional=True)),
           kwargs={"loss": KwSpec("config", "ppo_clip"),
                   "kl": KwSpec("float", 0.0, min=0.0, doc="KL-in-loss coefficient"),
                   "kl_kind": KwSpec("str", "k3", choices=KL_ESTIMATORS),
                   "entropy": KwSpec("float", 0.0, doc="entropy bonus coefficient"),
                   "tis": KwSpec("float", 0.0, min=0.0,
                                 doc="truncated importance sampling: cap of the weight "
                                     "pi_train / pi_rollout (behaviour); 0 = off"),
                   "mis": KwSpec("float", 0.0, min=0.0,
                                 doc="masked importance sampling: tokens (or sequences, see is_level) "
                                     "whose ratio pi_train / pi_rollout exceeds this carry no loss; 0 = off"),
                   "mis_low": KwSpec("float", 0.0, min=0.0,
                                     doc="lower end of the MIS band (0: 1 / mis when mis > 1)"),
                   "is_level": KwSpec("str", "token", choices=IS_LEVELS,
                                      doc="the ratio tis / mis act on: per token, per sequence (product of "
                                          "its tokens' ratios) or geometric (their geometric mean)"),
                   "auto_correct": KwSpec("bool", True,
                                          doc="when `schedule auto` picks staleness > 1 and this update has "
                                              "no correction (tis, mis), it adds tis = AUTO_TIS_CAP; false: "
                                              "train stale samples uncorrected"),
                   "lr": KwSpec("float", 1e-5, min=0.0),
                   "weight_decay": KwSpec("float", 0.0, min=0.0),
                   "beta1": KwSpec("float", 0.9, min=0.0, max=0.9999, doc="AdamW first-moment decay"),
                   "beta2": KwSpec("float", 0.999, min=0.0, max=0.99999, doc="AdamW second-moment decay"),
                   "grad_clip": KwSpec("float", 1.0, min=0.0),
                   "lr_schedule": KwSpec("str", "constant", choices=LR_SCHEDULES,
                                         doc="decay of the learning rate after the warm-up"),
                   "warmup": KwSpec("int", 0, min=0, doc="optimizer steps of linear learning-rate warm-up"),
                   "min_lr_ratio": KwSpec("float", 0.0, min=0.0, max=1.0,
                                          doc="the decayed learning rate's floor, as a fraction of lr"),
                   "schedule_steps": KwSpec("int", 0, min=0,
                                            doc="optimizer steps the schedule spans, warm-up included (0: the "
                                                "run's steps x epochs x minibatches)"),
                   "epochs": KwSpec("int", 1, min=1),
                   "minibatches": KwSpec("int", 1, min=1),
                   "micro_batch": KwSpec("int", 8, min=1),
                   "micro_batch_tokens": KwSpec("int", 0, min=0,
                                                doc="micro-batches of at most this many real tokens instead of "
                                                    "`micro_batch` rows, balanced over data-parallel ranks by "
                                                    "tokens; a longer sequence runs alone (0: by rows)"),
                   "pack": KwSpec("bool", False,
                                  doc="run each micro-batch as one row of its sequences end to end, attention "
                                      "kept within each sequence: no padding"),
                   "on_nan": KwSpec("str", "skip", choices=NAN_POLICIES,
                                    doc="a non-finite loss or gradient: skip that optimizer step and count it "
                                        "(faults/nan_skipped), or stop the run naming the op and step"),
                   "routing": _ROUTING},
           engine="train", effect=True,
           doc="One optimisation step of a trainable model on the step's samples."))
_op(OpSpec("resync", OpKind.RESYNC, (_a("model", "model"),),
           kwargs={"protocol": KwSpec("str", "auto"), "every": KwSpec("int", 1, min=1)},
           engine="rollout", effect=True,
           doc="Inserted by the compiler: push trained weights to the rollout engine."))
_op(OpSpec("env_step", OpKind.ENV_STEP, (_a("env", "env"), _a("rollouts", "data", "response_ids")),
           produces=_F({"prompt_ids", "observations", "done", "rewards"}), passthrough=1, engine="env",
           effect=True,
           doc="Run the environment / tools on each unfinished conversation: the observation's tokens are "
               "appended to it (masked out of the loss), `done` ends it; a `generate` reading the result "
               "continues each unfinished conversation (flowrl.runtime.episodes)."))
_op(OpSpec("agent_rollout", OpKind.GENERATE,
           (_a("model", "model"), _a("prompts", "data", "prompt_ids"), _a("env", "env")),
           kwargs={"n": KwSpec("int", 1, min=1, doc="episodes per prompt (the group)"),
                   "temperature": KwSpec("float", 1.0, min=0.0, doc="sampling temperature of every call; 0 is greedy"),
                   "top_p": KwSpec("float", 1.0, min=0.0, max=1.0),
                   "top_k": KwSpec("int", -1, min=-1),
                   "max_tokens": KwSpec("int", 64, min=1, doc="longest completion of one call"),
                   "stop": KwSpec("list", []),
                   "seed": KwSpec("int", 0)},
           produces=_F({*_TOKENS, "rollout_logprobs", "group_ids", "version", "rewards", "done", "truncated"}),
           passthrough=1, engine="rollout", effect=True, protocol="openai",
           doc="Run n episodes per prompt of an environment that drives the policy through the rollout endpoint "
               "(`agent(...)`): each episode's row is the tokens the engine saw and sampled, the model's masked in; "
               "`rewards` are what the programs returned (flowrl.runtime.agents)."))
_op(OpSpec("call", OpKind.USER_CALL, (_a("function", "str"),), variadic=True, python_ref="function",
           kwargs={"produces": KwSpec("list", [], doc="fields the function returns")},
           engine="driver", effect=True, doc="A user's Python function `module:function` on data values."))

OPTIMIZER_OPTIONS = ("lr", "weight_decay", "beta1", "beta2", "grad_clip", "lr_schedule", "warmup",
                     "min_lr_ratio", "schedule_steps")
"""The ``update`` options that configure the trained model's optimizer (the plan's
``ModelPlan.optim``, read by every train engine)."""

AUTO_TIS_CAP = 2.0
"""The ``tis`` cap ``schedule auto`` gives an uncorrected ``update`` when it picks staleness > 1
(``update(auto_correct = true)``, the default): veRL's and AReaL's usual truncation."""

# Names a flow may not bind or define: they are built in.
BUILTIN_NAMES = frozenset(OPS) | frozenset(LOSSES)

DECL_KINDS = {"model": OpKind.MODEL, "dataset": OpKind.DATASET, "reward": OpKind.REWARD_FN,
              "env": OpKind.ENV}
