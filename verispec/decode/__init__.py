"""Decoding: the batch loop (``batch.py``) and the public ``SpeculativeDecoder`` (``decoder.py``)."""

from .batch import DecodeBatch, Row
from .decoder import GenerateOutput, NonFiniteLogitsError, SpeculativeDecoder, shared_vocab_size

__all__ = ["DecodeBatch", "GenerateOutput", "NonFiniteLogitsError", "Row", "SpeculativeDecoder", "shared_vocab_size"]
