"""Drafters propose tokens for the target to verify, behind one small interface (``base.Drafter``)."""

from .base import Drafter, Proposal, per_row
from .composite import CompositeDrafter
from .cross_tokenizer import CrossTokenizerDrafter
from .early_exit import EarlyExitDrafter
from .model import ModelDrafter
from .ngram import NGramDrafter

__all__ = ["CompositeDrafter", "CrossTokenizerDrafter", "Drafter", "EarlyExitDrafter", "ModelDrafter", "NGramDrafter",
           "Proposal", "per_row"]
