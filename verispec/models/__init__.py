"""Models: the cached-model adapter with per-row rollback (``cache``), CPU kernels (``fast``), the llama.cpp
backend (``llamacpp``), EOS ids (``eos``) and one model with its tokenizer from resolved files or by name
(``loading``). Names become files in ``verispec.acquire`` (the zoo, its packages and checks, Hub ids); ``zoo`` is
re-exported here for ``verispec.zoo``. The factory that builds a decoder from names is ``verispec.factory``,
above this layer."""

from ..acquire import zoo
from .eos import chat_end_token_id, eos_token_ids
from .loading import LoadError, load_model

__all__ = ["LoadError", "chat_end_token_id", "eos_token_ids", "load_model", "zoo"]
