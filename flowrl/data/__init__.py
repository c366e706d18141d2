"""Datasets (local JSON-lines / Parquet rows) and the resumable batch sampler."""

from flowrl.data.datasets import DatasetError, load_rows
from flowrl.data.sampler import BatchSampler, SamplerStateError

__all__ = ["BatchSampler", "DatasetError", "SamplerStateError", "load_rows"]
