"""Helpers for engine tests: a tiny Llama checkpoint, a character tokenizer, batches, losses.

Built locally (no model hub). Sizes respect vLLM's CPU attention (head_dim >= 32).
"""

from __future__ import annotations

import torch

from flowrl.engines.types import Completion, TokenBatch

CHARS = "0123456789 +-=abcdefghijklmnopqrstuvwxyz"
SPECIALS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_tokenizer():
    """Character-level fast tokenizer: 3 specials + 40 characters (vocab 43)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(CHARS))}
    # BPE without merges splits text into single characters; Fuse joins them back.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )


def build_tiny_llama(path: str, seed: int = 0) -> str:
    """Save a 2-layer Llama (hidden 128, 4 heads, 2 kv heads, head_dim 32) + tokenizer into ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        # A wider init than the 0.02 default gives peaked next-token distributions,
        # so greedy decoding has clear winners (no near-ties between backends).
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def encode(text: str) -> list[int]:
    """BOS + character ids of ``text``."""
    return [BOS_ID] + [len(SPECIALS) + CHARS.index(c) for c in text]


PROMPTS = ["12+3=", "hello world", "7-2="]
"""Prompt texts the rollout tests use."""


def batch_of(completions: list[Completion]) -> TokenBatch:
    """Right-padded batch of prompt+response rows (the train engine's input)."""
    return TokenBatch.from_completions(completions, pad_id=PAD_ID)


def random_batch(rows: int = 6, seed: int = 0, vocab: int = 43) -> TokenBatch:
    """Rows of random lengths with a prompt part and a response part, right-padded."""
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for _ in range(rows):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        r = int(torch.randint(1, 9, (1,), generator=gen))
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        completions.append(Completion(tuple([BOS_ID] + ids[:p]), tuple(ids[p:]), (0.0,) * r, "length"))
    return batch_of(completions)


def sft_loss(outputs, micro, denominator):
    """Mean negative log-likelihood of response tokens over the whole batch."""
    return -(outputs["logprobs"] * micro.response_mask).sum() / denominator["tokens"]


def value_loss(outputs, micro, denominator):
    """Mean squared error of values against ``extras["returns"]`` on response tokens."""
    err = (outputs["values"] - micro.extras["returns"]) ** 2
    return (err * micro.response_mask).sum() / denominator["tokens"]


def make_trainer(model_dir: str, **kwargs):
    """A float32 actor train engine with a large learning rate, so a few steps visibly change it."""
    from flowrl.engines.torch_train import OptimConfig, TorchTrainEngine

    kwargs.setdefault("optim", OptimConfig(lr=1e-2, max_grad_norm=1.0))
    return TorchTrainEngine(model_dir, **kwargs)


def train_a_few_steps(engine, steps: int = 3) -> list[dict[str, float]]:
    """Take ``steps`` SFT steps on fixed random batches; returns the step metrics."""
    return [engine.train_step(random_batch(8, seed=100 + s), sft_loss, micro_batch_size=4) for s in range(steps)]


def completions_batch(groups) -> TokenBatch:
    """Flatten grouped completions into one right-padded train batch."""
    return batch_of([c for group in groups for c in group])


def max_logprob_gap(groups, trainer_logprobs: torch.Tensor, batch: TokenBatch) -> float:
    """Largest |rollout logprob - trainer logprob| over all response tokens of ``batch``."""
    rollout = batch.extras["rollout_logprobs"]
    mask = batch.response_mask.bool()
    return float((rollout[mask] - trainer_logprobs[mask]).abs().max())
