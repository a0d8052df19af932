"""One model and its tokenizer, on a device this process can use: from resolved files (:func:`load_files`, the
torch backend's loader, which knows nothing of zoos, packages or hashes) or by name (:func:`load_model`:
``verispec.acquire.resolve`` then :func:`load_files`); every loader error becomes a ``LoadError`` naming the
model. The factory that assembles a decoder from such models is ``verispec.factory`` (above ``decode``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..acquire import ModelFiles, Progress, ZooError, resolve, say

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["LoadError", "load_files", "load_model", "load_tokenizer", "parse_device", "parse_dtype",
           "parse_model_dtype", "same_tokenizer"]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                                   "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class LoadError(ValueError):
    """A model could not be loaded, or two models cannot be paired; the message says why in one line."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch dtype for ``torch.float32``/``bfloat16``/``float16`` or a name in ``_DTYPES`` (case-insensitive,
    an optional ``torch.`` prefix allowed); anything else raises ``ValueError`` naming the accepted values."""
    accepted = sorted(set(_DTYPES.values()), key=str)
    if isinstance(dtype, torch.dtype):
        if dtype in accepted:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"unsupported dtype {dtype!r}; accepted: {', '.join(_DTYPES)} or one of "
                     f"{', '.join(str(d) for d in accepted)}")


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


def load_tokenizer(files: ModelFiles, progress: Progress | None = None) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer in ``files.tokenizer`` (both backends use it); ``ValueError`` if none is usable."""
    from transformers import AutoTokenizer

    say(progress, f"loading tokenizer from {'cache ' if files.kind == 'gguf' else ''}{files.tokenizer}")
    try:
        return AutoTokenizer.from_pretrained(str(files.tokenizer), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {files.tokenizer}: {e}") from e


def model_class_for(config: Any) -> type:
    """The ``transformers`` auto class that loads a model of ``config``: ``AutoModelForCausalLM``, or for an
    encoder-decoder ``AutoModelForSeq2SeqLM`` (text to text: T5, BART, Marian) or ``AutoModelForSpeechSeq2Seq``
    (speech to text: Whisper). ``ValueError`` for an encoder-decoder of neither kind."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    if not getattr(config, "is_encoder_decoder", False):
        return AutoModelForCausalLM
    if config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForSeq2SeqLM
    if config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq
    raise ValueError(f"an encoder-decoder of type {config.model_type!r} that is neither text to text nor speech to "
                     "text: verispec decodes causal LMs and the encoder-decoders of AutoModelForSeq2SeqLM and "
                     "AutoModelForSpeechSeq2Seq")


def load_files(files: ModelFiles, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: Progress | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` from resolved files: the model in eval mode on ``device``, a GGUF's weights
    dequantised to ``dtype`` (always a plain dense model: packed-GGUF kernels would change numerics per device),
    a folder's cast to it. Reads local files only."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    tokenizer = load_tokenizer(files, progress)
    dtype_name = str(dtype).removeprefix("torch.")
    if files.kind == "gguf":
        if files.config is None:
            raise ValueError(f"{files.path.name} was resolved for llama.cpp: resolve it with backend='torch'")
        config = AutoConfig.from_pretrained(str(files.config), local_files_only=True)
        say(progress, f"loading weights from {files.path.name} (dequantising to {dtype_name}) ...")
        model = AutoModelForCausalLM.from_pretrained(str(files.path.parent), gguf_file=files.path.name, config=config,
                                                     dtype=dtype, quantization_config=GgufConfig(dequantize=True),
                                                     local_files_only=True)
    else:
        config = AutoConfig.from_pretrained(str(files.path), local_files_only=True)
        model_class = model_class_for(config)
        say(progress, f"loading weights from {files.path} ({dtype_name}"
                      f"{', an encoder-decoder' if model_class is not AutoModelForCausalLM else ''}) ...")
        model = model_class.from_pretrained(str(files.path), config=config, dtype=dtype, local_files_only=True)
    model.eval()
    if torch.device(device).type != "cpu":
        model.to(device)
    return model, tokenizer


def load_model(name_or_path: str, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               progress: Progress | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """One model (eval mode, on ``device``) and its tokenizer by zoo name, path or Hub id (``acquire.resolve``,
    then :func:`load_files`); ``dtype`` None means float32. Every loader error becomes a ``LoadError`` naming the
    model; a bad dtype or device fails before any work."""
    torch_dtype, torch_device = parse_model_dtype(dtype), parse_device(device)
    try:
        return load_files(resolve(name_or_path, backend="torch", progress=progress), torch_dtype, torch_device,
                          progress)
    except (ZooError, ValueError, OSError) as error:
        raise LoadError(f"cannot load model {name_or_path!r}: {error}") from error


def same_tokenizer(target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers map every token string to the same id (one vocabulary)."""
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()
