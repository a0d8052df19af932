"""Load one model and its tokenizer by zoo name, path, ``.gguf`` file or Hub id (see ``sources``), on a device
this process can use; every loader error becomes a ``LoadError`` naming the model. The factory that assembles a
decoder from such models is ``verispec.factory`` (it sits above ``decode``, ``drafters`` and ``policy``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .integrity import Progress, ZooError
from .sources import load_pretrained, parse_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["LoadError", "load_model", "parse_device", "parse_model_dtype", "same_tokenizer"]

class LoadError(ValueError):
    """A model could not be loaded, or two models cannot be paired; the message says why in one line."""


def parse_model_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` as a torch dtype (None: float32, what GGUF weights are dequantised to by default)."""
    try:
        return parse_dtype("float32" if dtype is None else dtype)
    except ValueError as error:
        raise LoadError(str(error)) from error


def parse_device(device: str | torch.device, here: bool = True) -> torch.device:
    """``device`` as a torch device; with ``here``, also one this process can use (not ``cuda`` on a torch
    built without CUDA, which would otherwise end in an ``AssertionError`` once the weights are loaded)."""
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise LoadError(f"unknown device {device!r}: {error}") from error
    problem = _device_unavailable(torch_device) if here else None
    if problem is not None:
        raise LoadError(f"device {str(device)!r} is not available: {problem}")
    return torch_device


def _device_unavailable(device: torch.device) -> str | None:
    """Why this process cannot use ``device``, or None (devices other than CUDA and MPS are left to torch)."""
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            return (f"this torch ({torch.__version__}) was built without CUDA; use device 'cpu', or install a "
                    "CUDA build of torch")
        count = torch.cuda.device_count()
        if count == 0:
            return "torch sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)"
        if device.index is not None and device.index >= count:
            return f"torch sees {count} CUDA GPU(s), numbered from 0"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    return None


def load_model(name_or_path: str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               progress: Progress | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """One model (eval mode, on ``device``) and its tokenizer by zoo name, path or Hub id; ``dtype`` None means
    float32. Every loader error becomes a ``LoadError`` naming the model."""
    torch_dtype = parse_model_dtype(dtype)
    try:
        return load_pretrained(name_or_path, dtype=torch_dtype, device=str(parse_device(device)), progress=progress)
    except (ZooError, ValueError, OSError) as error:
        raise LoadError(f"cannot load model {name_or_path!r}: {error}") from error


def same_tokenizer(target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers map every token string to the same id (one vocabulary)."""
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()
