"""Offline generation jobs (``verispec batch``): rows of prompts in, the same rows plus completions out; resumable,
reproducible, in-process or over Ray Data actors."""

from .job import BatchSummary, run_batch
from .worker import GroupDecoder, JobDefaults

__all__ = ["BatchSummary", "GroupDecoder", "JobDefaults", "run_batch"]
