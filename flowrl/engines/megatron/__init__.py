"""The Megatron-core train engine (tensor / pipeline / data parallel) and its HF <-> Megatron conversion.

Importing this package does not import Megatron: :mod:`.convert` is plain torch, and
the engine imports ``megatron.core`` only inside its rank processes.

* :mod:`.convert`: transformers Llama / Llama 3.x / Mistral / Qwen2 / Qwen3 <-> Megatron ``GPTModel`` state dicts.
* :mod:`.worker`: :class:`MegatronRank`, one process's model shard and optimizer.
* :mod:`.engine`: :class:`MegatronTrainEngine`, the ``TrainEngine`` over a group of ranks.
* :mod:`.cpu_shims`: the patches Megatron needs without CUDA (rank processes only).
"""

from flowrl.engines.megatron.convert import ConversionError, Layout, ModelSpec
from flowrl.engines.megatron.engine import MegatronRankError, MegatronTrainEngine

__all__ = ["ConversionError", "Layout", "MegatronRankError", "MegatronTrainEngine", "ModelSpec"]
