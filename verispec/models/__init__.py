"""Models: the cached-model adapter with per-row rollback, CPU kernels, the offline zoo and the factory."""

from . import zoo
from .loading import LoadError, check_same_tokenizer, eos_token_ids, load, load_model

__all__ = ["LoadError", "check_same_tokenizer", "eos_token_ids", "load", "load_model", "zoo"]
