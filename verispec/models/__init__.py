"""Models: the cached-model adapter with per-row rollback (``cache``), CPU kernels (``fast``), the offline zoo
(``zoo``, with verified files in ``integrity``), loading by name, path or Hub id (``sources``), EOS ids
(``eos``) and the factory that builds a decoder (``loading``)."""

from . import zoo
from .eos import chat_end_token_id, eos_token_ids
from .loading import LoadError, check_same_tokenizer, load, load_model

__all__ = ["LoadError", "chat_end_token_id", "check_same_tokenizer", "eos_token_ids", "load", "load_model", "zoo"]
