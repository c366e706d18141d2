"""Datasets (local JSON-lines / Parquet files, `datasets` directories, shards), their row format and samplers."""

from flowrl.data.datasets import DatasetError, load_rows
from flowrl.data.sampler import BatchSampler, MixSampler, SamplerStateError, StreamSampler

__all__ = ["BatchSampler", "DatasetError", "MixSampler", "SamplerStateError", "StreamSampler", "load_rows"]
