"""The closed set of op kinds and the catalogue of built-in ops (and losses: :mod:`.losses`).

An op declares what it reads (positional arguments, each a resource or a data value
with the *fields* it needs), its keyword options (type and default) and the fields it
produces. The compiler checks flows against this table; it is data, not code, so the
compiler never needs an engine to know what an op does.

Fields are the columns of the step's experience table (one row per sample):

==================  ==========================================================
``prompt_ids``      prompt token ids                          [B, P] int
``answers``         ground-truth answers from the dataset     [B] str
``response_ids``    generated token ids                       [B, R] int
``response_mask``   1 on response tokens                      [B, R]
``rollout_logprobs`` sampler's per-token log-probs            [B, R] float
``group_ids``       which prompt a completion answers         [B] int
``version``         policy version that generated the sample  [B] int
``rewards``         scalar reward per sample                  [B] float
``token_rewards``   reward per token (KL-shaped)              [B, R] float
``logprobs``        per-token log-probs under a model         [B, R] float
``entropy``         per-token entropy                         [B, R] float
``values``          per-token critic values                   [B, R] float
``advantages``      per-token (or per-sample) advantages      [B, R] float
``returns``         per-token returns (critic targets)        [B, R] float
``done``            the episode ended (agentic flows)         [B] bool
``observations``    tool/environment output tokens            [B, O] int
==================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from flowrl.catalog.losses import KL_ESTIMATORS, LOSSES
from flowrl.catalog.spec import ArgSpec, KwSpec


class OpKind(str, Enum):
    """What a graph node is. Resources are read by ops; the rest are the step's ops."""

    # resources
    MODEL = "model"          # weights: hf(...), tiny(...), frozen(m), critic(m), or a flow parameter
    DATASET = "dataset"      # jsonl(...), parquet(...)
    REWARD_FN = "reward_fn"  # verifier(...), python_reward(...), reward_model(m)
    ENV = "env"              # python_env(...): a tool/environment for multi-turn flows
    # step ops
    SAMPLE = "sample"        # draw a batch of prompts
    GENERATE = "generate"    # rollout engine: sample completions
    SCORE = "score"          # reward function on completions
    LOGPROBS = "logprobs"    # train engine forward: per-token log-probs (and entropy)
    VALUES = "values"        # critic forward: per-token values
    ADVANTAGE = "advantage"  # driver-side math: advantages, returns, reward shaping
    UPDATE = "update"        # train engine: loss, backward, optimizer step
    RESYNC = "resync"        # weights from the trainer to the rollout engine (compiler-inserted)
    ENV_STEP = "env_step"    # environment / tool step in a multi-turn loop
    USER_CALL = "user_call"  # a user's Python function on data
    CALL = "call"            # an unresolved call of a flow; gone after resolve_names


RESOURCE_KINDS = frozenset({OpKind.MODEL, OpKind.DATASET, OpKind.REWARD_FN, OpKind.ENV})
PRODUCER_KINDS = frozenset({OpKind.SAMPLE, OpKind.GENERATE, OpKind.SCORE})
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
    doc: str = ""
    handler: str | None = None
    """What serves it at run time, by name: a step op's handler in the runtime's ``HANDLERS``
    table; a resource's builder in the runtime's table of its kind (model sources, dataset
    formats, reward kinds, environment kinds). Tests pair every name with the runtime."""
    group_option: str | None = None
    """Ops computed per group of completions: the option giving the group size (the compiler
    checks that groups have more than one member, else every result would be 0)."""


def _a(name, type_, *needs, optional=False, doc=""):
    return ArgSpec(name, type_, frozenset(needs), optional, doc)


_TOKENS = ("prompt_ids", "response_ids", "response_mask")
_F = frozenset

OPS: dict[str, OpSpec] = {}


def _op(spec: OpSpec) -> None:
    # Every op is served at run time by the entry of its own name, unless it says otherwise.
    OPS[spec.name] = spec if spec.handler else replace(spec, handler=spec.name)


# ---- resources ------------------------------------------------------------------
_op(OpSpec("hf", OpKind.MODEL, (_a("path", "str"),), role="trainable",
           kwargs={"dtype": KwSpec("str", "float32", choices=("float32", "bfloat16", "float16")),
                   "max_len": KwSpec("int", 512, min=8)},
           doc="A transformers checkpoint: a local directory or a hub id."))
_op(OpSpec("tiny", OpKind.MODEL, (), role="trainable",
           kwargs={"task": KwSpec("str", "arith"), "hidden": KwSpec("int", 128, min=32),
                   "layers": KwSpec("int", 2, min=1), "heads": KwSpec("int", 4, min=1),
                   "kv_heads": KwSpec("int", 2, min=1),
                   "warm_start": KwSpec("int", None, min=0, doc="SFT steps (default: the task's)"),
                   "seed": KwSpec("int", 0)},
           doc="A tiny Llama-style model built locally for `task` and warm-started by SFT (cached)."))
_op(OpSpec("frozen", OpKind.MODEL, (_a("model", "model"),), role="frozen", handler="derived",
           doc="A frozen copy of a model's initial weights (e.g. the KL reference)."))
_op(OpSpec("critic", OpKind.MODEL, (_a("model", "model"),), role="critic", handler="derived",
           doc="A trainable value model initialised from a model, with a scalar value head."))
_op(OpSpec("jsonl", OpKind.DATASET, (_a("path", "str"),),
           kwargs={"prompt": KwSpec("str", "prompt"), "answer": KwSpec("str", "answer"),
                   "eval": KwSpec("str", "", doc="held-out split, scored greedily during a run")},
           doc="A local JSON-lines dataset with a prompt field and an answer field."))
_op(OpSpec("parquet", OpKind.DATASET, (_a("path", "str"),),
           kwargs={"prompt": KwSpec("str", "prompt"), "answer": KwSpec("str", "answer"),
                   "eval": KwSpec("str", "", doc="held-out split, scored greedily during a run")},
           doc="A local parquet dataset with a prompt column and an answer column."))
_op(OpSpec("verifier", OpKind.REWARD_FN, (_a("name", "str"),),
           kwargs={"correct": KwSpec("float", 1.0), "wrong": KwSpec("float", 0.0)},
           doc="A named rule verifier: \"math\" (math-verify) or \"exact\"."))
_op(OpSpec("python_reward", OpKind.REWARD_FN, (_a("function", "str"),),
           kwargs={"workers": KwSpec("int", 2, min=1), "on_error": KwSpec("float", 0.0)},
           doc="A Python reward function given as \"module:function\"."))
_op(OpSpec("reward_model", OpKind.REWARD_FN, (_a("model", "model"),),
           doc="A served reward model (a frozen sequence scorer)."))
_op(OpSpec("python_env", OpKind.ENV, (_a("cls", "str"),),
           kwargs={"timeout": KwSpec("float", 10.0, min=0)},
           doc="An environment / tool class given as \"module:Class\"."))

# ---- step ops ----------------------------------------------------------------------
_op(OpSpec("sample", OpKind.SAMPLE, (_a("dataset", "dataset"),),
           kwargs={"size": KwSpec("int", 64, min=1, doc="prompts per step")},
           produces=_F({"prompt_ids", "answers"}), engine="driver",
           doc="Draw the step's prompts from a dataset (deterministic, resumable cursor)."))
_op(OpSpec("generate", OpKind.GENERATE, (_a("model", "model"), _a("prompts", "data", "prompt_ids")),
           kwargs={"n": KwSpec("int", 1, min=1, doc="completions per prompt"),
                   "temperature": KwSpec("float", 1.0, min=0.0),
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
           kwargs={"entropy": KwSpec("bool", False)},
           produces=_F({"logprobs"}), engine="train",
           doc="Per-token log-probs of the rollouts under a model (train engine forward)."))
_op(OpSpec("values", OpKind.VALUES, (_a("critic", "model"), _a("rollouts", "data", *_TOKENS)),
           produces=_F({"values"}), engine="train", doc="Per-token values from a critic."))
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
                                 doc="truncated importance sampling cap for rollout/train mismatch; 0 = off"),
                   "lr": KwSpec("float", 1e-5, min=0.0),
                   "weight_decay": KwSpec("float", 0.0, min=0.0),
                   "beta1": KwSpec("float", 0.9, min=0.0, max=0.9999, doc="AdamW first-moment decay"),
                   "beta2": KwSpec("float", 0.999, min=0.0, max=0.99999, doc="AdamW second-moment decay"),
                   "grad_clip": KwSpec("float", 1.0, min=0.0),
                   "epochs": KwSpec("int", 1, min=1),
                   "minibatches": KwSpec("int", 1, min=1),
                   "micro_batch": KwSpec("int", 8, min=1)},
           engine="train", doc="One optimisation step of a trainable model on the step's samples."))
_op(OpSpec("resync", OpKind.RESYNC, (_a("model", "model"),),
           kwargs={"protocol": KwSpec("str", "auto"), "every": KwSpec("int", 1, min=1)},
           engine="rollout", doc="Inserted by the compiler: push trained weights to the rollout engine."))
_op(OpSpec("env_step", OpKind.ENV_STEP, (_a("env", "env"), _a("rollouts", "data", "response_ids")),
           produces=_F({"prompt_ids", "observations", "done", "rewards"}), passthrough=1, engine="env",
           doc="Run the environment / tools on each unfinished conversation."))
_op(OpSpec("call", OpKind.USER_CALL, (_a("function", "str"),), variadic=True,
           kwargs={"produces": KwSpec("list", [], doc="fields the function returns")},
           engine="driver", doc="A user's Python function `module:function` on data values."))

# Names a flow may not bind or define: they are built in.
BUILTIN_NAMES = frozenset(OPS) | frozenset(LOSSES)

DECL_KINDS = {"model": OpKind.MODEL, "dataset": OpKind.DATASET, "reward": OpKind.REWARD_FN,
              "env": OpKind.ENV}
