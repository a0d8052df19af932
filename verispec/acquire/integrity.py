"""Verified model files: size and sha256 checks (remembered in markers), assembly from parts, atomic writes.

Guarantees:

* :func:`verify_gguf` returns a file only after its size and sha256 matched (now, or earlier with a marker
  that still matches the file's resolved path, size and mtime); a mismatch raises :class:`ZooError`;
* :func:`assemble_gguf` creates its destination only complete and verified (written to a temp file next to
  it, hashed while written, then renamed atomically);
* :func:`save_atomic_dir` and the markers are written the same way, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

Progress = Callable[[str], None]

_CHUNK = 8 * 1024 * 1024  # streaming block for concatenation and hashing

__all__ = ["Progress", "ZooError", "assemble_gguf", "save_atomic_dir", "say", "verify_gguf"]


class ZooError(RuntimeError):
    """A model could not be found, installed, assembled, verified or loaded; the message says which and why."""


def say(progress: Progress | None, msg: str) -> None:
    """Send one progress line to ``progress`` if there is one."""
    if progress is not None:
        progress(msg)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _atomic_file(path: Path, mode: str) -> Iterator:
    """A temp file next to ``path``, open in ``mode``: renamed to ``path`` if the block ends normally, removed if
    it raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_atomic_dir(final: Path, save: Callable[[Path], None]) -> None:
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


def _marker(gguf: Path, marker: Path | None) -> Path:
    return Path(marker) if marker is not None else gguf.with_name(gguf.name + ".verified.json")


def _marker_matches(marker: Path, gguf: Path, expected_sha256: str) -> bool:
    """True if ``marker`` vouches for ``gguf`` as it is now (same path, size, mtime, hash)."""
    try:
        rec = json.loads(marker.read_text())
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    return (isinstance(rec, dict) and rec.get("path") == str(gguf.resolve()) and rec.get("size") == st.st_size
            and rec.get("mtime_ns") == st.st_mtime_ns and rec.get("sha256") == expected_sha256.lower())


def _write_marker(marker: Path, gguf: Path, sha256: str) -> None:
    st = gguf.stat()
    rec = {"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    with _atomic_file(marker, "w") as f:
        f.write(json.dumps(rec, indent=1) + "\n")


def verify_gguf(path: Path, expected_size: int, expected_sha256: str, *, marker: Path | None = None,
                progress: Progress | None = None) -> Path:
    """``path``, once its size and sha256 matched (:class:`ZooError` if not, or if it is missing). The sha256 is
    recomputed unless ``marker`` (default ``<path>.verified.json``) vouches for this very file; after a
    successful hash the marker is (re)written."""
    path = Path(path)
    marker = _marker(path, marker)
    if not path.is_file():
        raise ZooError(f"GGUF not found: {path}")
    size = path.stat().st_size
    if size != expected_size:
        raise ZooError(f"size mismatch for {path}: expected {expected_size:,} bytes, found {size:,}")
    if _marker_matches(marker, path, expected_sha256):
        return path
    say(progress, f"verifying sha256 of {path.name} ({_mb(size)}) ...")
    found = _hash_file(path)
    if found != expected_sha256.lower():
        raise ZooError(f"sha256 mismatch for {path}: expected {expected_sha256.lower()}, found {found}")
    _write_marker(marker, path, found)
    return path


def _check_parts(parts: list[Path], dest: Path, expected_size: int) -> int:
    """The parts' total size, after checking that every part exists and that they add up to the expected size."""
    if not parts:
        raise ZooError(f"no parts given to assemble {dest.name}")
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ZooError(f"missing part file(s) for {dest.name}: {', '.join(missing)}")
    total = sum(p.stat().st_size for p in parts)
    if total != expected_size:
        raise ZooError(f"size mismatch for {dest.name}: expected {expected_size:,} bytes, the {len(parts)} parts add "
                       f"up to {total:,}")
    return total


def _concatenate(parts: list[Path], out, name: str, progress: Progress | None) -> tuple[int, str]:
    """Stream ``parts`` in order into the open file ``out``; returns the bytes written and their sha256."""
    h = hashlib.sha256()
    written = 0
    for i, part in enumerate(parts, 1):
        if len(parts) > 1:
            say(progress, f"assembling {name}: part {i}/{len(parts)}")
        with open(part, "rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
                out.write(block)
                written += len(block)
    out.flush()
    os.fsync(out.fileno())
    return written, h.hexdigest()


def assemble_gguf(parts: Sequence[Path], dest: Path, expected_size: int, expected_sha256: str, *,
                  marker: Path | None = None, progress: Progress | None = None) -> Path:
    """Concatenate ``parts`` in order into ``dest``, which appears only complete and verified (see the module's
    guarantees; :class:`ZooError` names expected vs found); return ``dest``. The parts' total size is checked
    before anything is written; a marker (default ``<dest>.verified.json``) spares :func:`verify_gguf` the
    rehash later."""
    parts = [Path(p) for p in parts]
    dest = Path(dest)
    marker = _marker(dest, marker)
    total = _check_parts(parts, dest, expected_size)
    say(progress, f"assembling {dest.name} from {len(parts)} part(s) ({_mb(total)}) ...")
    with _atomic_file(dest, "wb") as out:
        written, found = _concatenate(parts, out, dest.name, progress)
        say(progress, f"verifying sha256 of {dest.name} ...")
        # Parts can change between the size check above and the read: check what was really written.
        if written != expected_size:
            raise ZooError(f"size mismatch for {dest.name}: expected {expected_size:,} bytes, wrote {written:,}")
        if found != expected_sha256.lower():
            raise ZooError(f"sha256 mismatch for {dest.name} assembled from {len(parts)} part(s): "
                           f"expected {expected_sha256.lower()}, found {found}")
    _write_marker(marker, dest, found)
    return dest
