"""Models: the cached-model adapter with per-row rollback (``cache``), CPU kernels (``fast``), the offline zoo
(``zoo``, with verified files in ``integrity``), loading by name, path or Hub id (``sources``), EOS ids
(``eos``) and one model with its tokenizer (``loading``). The factory that builds a decoder from names is
``verispec.factory``, above this layer."""

from . import zoo
from .eos import chat_end_token_id, eos_token_ids
from .loading import LoadError, load_model

__all__ = ["LoadError", "chat_end_token_id", "eos_token_ids", "load_model", "zoo"]
