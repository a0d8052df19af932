"""Decoding: request validation (``requests.py``), the batch loop (``batch.py``) and the public
``SpeculativeDecoder`` (``decoder.py``)."""

from .batch import DecodeBatch, Row
from .decoder import GenerateOutput, MemoryFullError, NonFiniteLogitsError, SpeculativeDecoder, shared_vocab_size
from .requests import ModelLimits, Request, validate_request

__all__ = [
    "DecodeBatch", "GenerateOutput", "MemoryFullError", "ModelLimits", "NonFiniteLogitsError", "Request", "Row",
    "SpeculativeDecoder", "shared_vocab_size", "validate_request",
]
