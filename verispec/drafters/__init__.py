"""Drafters propose tokens for the target to verify, behind one small interface (``base.Drafter``)."""

from .base import Drafter, Proposal, SourceDrafter, per_row
from .composite import CompositeDrafter
from .cross_tokenizer import CrossTokenizerDrafter
from .early_exit import EarlyExitDrafter
from .intersection import IntersectionDrafter
from .model import ModelDrafter
from .ngram import NGramDrafter
from .suffix import SuffixDrafter

__all__ = ["CompositeDrafter", "CrossTokenizerDrafter", "Drafter", "EarlyExitDrafter", "IntersectionDrafter",
           "ModelDrafter", "NGramDrafter", "Proposal", "SourceDrafter", "SuffixDrafter", "per_row"]
