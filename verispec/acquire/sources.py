"""One name to checked local files: :func:`resolve`, the one entry every loader goes through.

A name is, in this order:

1. a zoo name (``zoo.ZOO``): its packages installed, its GGUF assembled and its sha256 checked (``zoo``);
2. an existing local path: a folder with ``config.json`` (Hugging Face layout), a ``.gguf`` file, or a folder
   holding exactly one ``.gguf``; read as it is, nothing contacts a hub;
3. a Hub id shaped ``owner/name``: its files fetched into the Hugging Face cache (``HF_HOME`` /
   ``HF_HUB_CACHE``, the network unless ``HF_HUB_OFFLINE=1``); when one quick request finds the Hub
   unreachable, only that cache is searched (not a minute of retries per file);
4. anything else is an error naming what was tried.

A GGUF's tokenizer (and, for torch, its config) are converted to Hugging Face files once and cached under
``<cache>/hf/``, since converting a 150k-entry vocabulary in Python takes longer than loading the weights.
The backends then load from the :class:`ModelFiles` alone.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import zoo
from .integrity import Progress, ZooError, save_atomic_dir, say

__all__ = ["ModelFiles", "check_source", "hub_unreachable", "is_gguf", "is_hub_id", "resolve"]

# Seconds the one request that tells whether the Hub answers may take (huggingface_hub's own file requests
# wait 10 s each and retry five times with backoff: about a minute per file without a network).
HUB_PROBE_TIMEOUT_S = 5.0

# The files of a Hub repository transformers reads: configs, tokenizer files, safetensors weights as
# save_pretrained names them (not a repository's other copies, such as Mistral's consolidated.safetensors);
# PyTorch pickles only where a repository has no safetensors.
HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "model.safetensors", "model-*-of-*.safetensors"]
HUB_PICKLES = ["pytorch_model.bin", "pytorch_model-*-of-*.bin"]

Source = Literal["zoo", "folder", "gguf", "hub"]


@dataclass(frozen=True)
class ModelFiles:
    """A model as local files, ready for a backend; a zoo GGUF's size and sha256 were checked.

    ``path``: a Hugging Face model folder (``kind`` ``"transformers"``) or one GGUF file (``"gguf"``);
    ``tokenizer``: the folder of the tokenizer's files (for a GGUF, converted from its vocabulary);
    ``config``: the folder of ``config.json`` (for a GGUF, converted from it; None when resolved for llama.cpp);
    ``source``: where the name led (``"zoo"``, ``"folder"``, ``"gguf"`` or ``"hub"``)."""

    name: str
    kind: Literal["transformers", "gguf"]
    path: Path
    tokenizer: Path
    config: Path | None
    source: Source


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


def _gguf_in(path: Path) -> Path:
    """``path`` itself if it is a ``.gguf`` file, or the single ``.gguf`` in the folder ``path``."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ZooError(f"{path} is not a model folder: it has no config.json and {len(ggufs)} .gguf files "
                           "(need exactly one)")
        return ggufs[0]
    if path.suffix.lower() != ".gguf":
        raise ZooError(f"{path} is neither a .gguf file nor a model folder with config.json")
    return path


def _source(name_or_path: str) -> tuple[Source, Path]:
    """Where ``name_or_path`` leads, decided without reading weights or contacting anything: ``("zoo", _)``,
    ``("folder", folder)``, ``("gguf", file)`` or ``("hub", _)``; :class:`ZooError` for a missing path, a folder
    that is no model or a name that is none of these."""
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
    raise ZooError(f"{name_or_path!r} is neither a zoo model nor an existing path nor a Hugging Face Hub id "
                   f"(owner/name); known zoo models: {', '.join(zoo.ZOO)}")


def check_source(name_or_path: str) -> None:
    """Raise :class:`ZooError` if :func:`resolve` would refuse ``name_or_path`` before fetching anything
    (unknown name, missing path, a folder that is no model), so that a caller loading several models can refuse
    the last one's typo before spending minutes on the first. Reads no weights and contacts nothing."""
    _source(name_or_path)


def is_gguf(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF (a zoo name, a ``.gguf`` file, a folder holding one), without
    installing or reading anything; False for names :func:`check_source` refuses."""
    try:
        return _source(name_or_path)[0] in ("zoo", "gguf")
    except ZooError:
        return False


def gguf_size(name_or_path: str) -> int | None:
    """The bytes of the GGUF ``name_or_path`` names (a zoo entry's recorded size, a file's), without installing or
    reading anything; None for anything else."""
    try:
        kind, path = _source(name_or_path)
    except ZooError:
        return None
    if kind == "zoo":
        return zoo.ZOO[name_or_path].size
    return path.stat().st_size if kind == "gguf" else None


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


def _converted(gguf: Path, folder: Path, kind: Literal["tokenizer", "config"], progress: Progress | None) -> Path:
    """``folder``, holding the GGUF's tokenizer or config as Hugging Face files, converted once (for llama/qwen2
    transformers builds even the config by parsing every GGUF field, the vocabulary included, in Python)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = kind == "tokenizer"
    if not (folder / ("tokenizer_config.json" if tokenizer else "config.json")).is_file():
        say(progress, f"converting tokenizer from {gguf.name} (done once, then cached) ..." if tokenizer
            else f"reading config from {gguf.name} ...")
        loader = AutoTokenizer if tokenizer else AutoConfig
        loaded = loader.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        save_atomic_dir(folder, lambda d: loaded.save_pretrained(str(d)))
    return folder


# ------------------------------------------------------------------- the Hub


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


def _fetch_hub(repo_id: str, progress: Progress | None) -> Path:
    """The local snapshot folder of Hub repository ``repo_id``: its files fetched into the HF cache, except that
    a Hub which does not answer one quick request (:func:`hub_unreachable`) leaves the HF cache only; any failure
    becomes one :class:`ZooError` naming the id and where it was looked for."""
    from huggingface_hub import constants, snapshot_download

    unreachable = hub_unreachable()
    if unreachable is not None:
        say(progress, f"the Hugging Face Hub ({constants.ENDPOINT}) does not answer ({unreachable}): "
                      "looking in the local cache only")
    local_only = unreachable is not None or constants.is_offline_mode()
    say(progress, f"fetching {repo_id} (Hugging Face Hub id; cache {constants.HF_HUB_CACHE}) ...")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=local_only))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(repo_id, allow_patterns=HUB_PICKLES, local_files_only=local_only))
    except (OSError, ValueError) as e:  # huggingface_hub's lookup and HTTP errors are both
        prefix = (f"{repo_id!r} is no zoo model and no local path, and as a Hugging Face Hub id it could not be "
                  "loaded")
        if unreachable is not None:
            raise ZooError(f"{prefix}: the Hub ({constants.ENDPOINT}) does not answer ({unreachable}) and the local "
                           f"cache {constants.HF_HUB_CACHE} does not hold it (download it where there is a network, "
                           "or set HF_HUB_CACHE to a cache that holds it)") from e
        cache = constants.HF_HUB_CACHE
        searched = (f"only the local cache {cache} was searched, since HF_HUB_OFFLINE is set"
                    if constants.is_offline_mode() else f"searched the Hub and the local cache {cache}")
        raise ZooError(f"{prefix} ({searched}): {_one_line(e)}") from e
    return folder


# ------------------------------------------------------------------ the entry


def resolve(name_or_path: str, *, backend: Literal["torch", "llama.cpp"] = "torch", progress: Progress | None = None,
            cache: Path | None = None) -> ModelFiles:
    """The local files of ``name_or_path`` (see the module docstring for what a name may be). A GGUF's config
    is converted only for ``backend`` "torch" (llama.cpp reads the GGUF itself, and refuses anything else).
    ``progress``, if given, receives one line per step; ``cache``: verispec's cache folder (default
    :func:`zoo.cache_root`). Loads no weights.

    Raises :class:`ZooError` for an unknown name, a missing path, a folder that is no model, a Hub id that
    cannot be fetched, a failed install or verification, or a model that is no GGUF for llama.cpp.
    """
    if backend not in ("torch", "llama.cpp"):
        raise ValueError(f"backend must be 'torch' or 'llama.cpp', got {backend!r}")
    cache = cache if cache is not None else zoo.cache_root()
    source, path = _source(name_or_path)
    if backend == "llama.cpp" and source not in ("zoo", "gguf"):
        raise ZooError(f"backend 'llama.cpp' runs GGUF models only; {name_or_path!r} is not one "
                       "(a zoo name, a .gguf file or a folder holding one); use backend='torch'")
    if source in ("folder", "hub"):
        folder = path if source == "folder" else _fetch_hub(name_or_path, progress)
        return ModelFiles(name_or_path, "transformers", folder, folder, folder, source)
    sha256 = None
    if source == "zoo":
        path, sha256 = zoo.resolve_gguf(name_or_path, progress=progress, cache=cache), zoo.ZOO[name_or_path].sha256
    converted = cache / "hf" / _hf_cache_key(path, sha256)
    tokenizer = _converted(path, converted / "tokenizer", "tokenizer", progress)
    config = _converted(path, converted / "config", "config", progress) if backend == "torch" else None
    return ModelFiles(name_or_path, "gguf", path, tokenizer, config, source)
