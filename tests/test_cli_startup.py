"""What the command line does before any model loads: help and version without importing torch or
transformers, every argument that needs no model refused at once in one line (exit 2), ``--debug`` before or
after the command. The loaders are replaced by functions that fail the test if called."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.cli import CliError, build_parser, main

HEAVY = ("torch", "transformers", "huggingface_hub", "numpy", "tokenizers", "safetensors")
HELP_ARGVS = [["--help"], ["--version"], ["generate", "--help"], ["demo", "--help"], ["batch", "--help"],
              ["serve", "--help"], []]


def _heavy(modules: list[str]) -> list[str]:
    return sorted({name for name in modules if name.split(".")[0] in HEAVY})


def test_help_and_version_import_no_heavy_module() -> None:
    """Parsing, --help and --version in a fresh interpreter leave torch & co. unimported (they take seconds)."""
    script = f"""
import contextlib, io, json, sys
from verispec.cli import main
for argv in {HELP_ARGVS!r}:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code
    assert code in (0, None) and out.getvalue().strip(), (argv, code)
print(json.dumps(sorted(sys.modules)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert _heavy(json.loads(result.stdout)) == []


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["--version"]])
def test_the_module_entry_point_imports_no_heavy_module(argv: list[str]) -> None:
    """``python -m verispec`` as the console script runs it, measured by the interpreter's own import log."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "verispec", *argv], capture_output=True,
                            text=True, check=True)
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    assert "verispec.cli" in imported
    assert _heavy(imported) == []
    assert "verispec" in result.stdout


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load a model fails the test."""
    from verispec import acquire, factory
    from verispec.models import loading

    def refuse(*args, **kwargs):
        raise AssertionError(f"a model was loaded: {args}")

    for module in (acquire, factory, loading):  # every name of the one entry, and the loader above it
        monkeypatch.setattr(module, "resolve", refuse)
    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(factory, "load_model", refuse)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hello"}\n')
    return {"rows": str(rows), "out": str(tmp_path / "out.jsonl"), "missing": str(tmp_path / "missing.txt"),
            "no_folder": str(tmp_path / "no" / "such" / "out.jsonl"), "folder": str(tmp_path)}


def _one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("verispec: error:"), captured.err
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature must be a number >= 0"),
        (["generate", "--prompt", "x", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--top-k", "0"], "top_k must be an integer"),
        (["generate", "--prompt", "x", "--min-p", "1.5"], "min_p must be in [0, 1]"),
        (["generate", "--prompt", "x", "--presence-penalty", "3"], "presence_penalty must be a number in [-2, 2]"),
        (["generate", "--prompt", "x", "--repetition-penalty", "0"], "repetition_penalty must be a number > 0"),
        (["generate", "--prompt", "x", "--min-tokens", "-1"], "min_tokens must be an integer"),
        (["generate", "--prompt", "x", "--max-new-tokens", "-1"], "max_new_tokens must be an integer >= 0"),
        (["generate", "--prompt", ""], "the prompt is empty (--prompt)"),
        (["generate", "--prompt-file", "MISSING"], "cannot read --prompt-file"),
        (["generate", "--prompt", "x", "--draft", "MISSING"], "does not exist"),
        (["generate", "--prompt", "x", "--target", "FOLDER"], "is not a model folder"),
        (["generate", "--prompt", "x", "--target", "no-such-zoo-model"], "known zoo models"),
        (["generate", "--prompt", "x", "--dtype", "float13"], "unsupported dtype"),
        (["generate", "--prompt", "x", "--num-draft-tokens", "-1"], "num_draft_tokens must be"),
        (["generate", "--prompt", "x", "--num-draft-tokens", "many"], "--num-draft-tokens must be"),
        (["generate", "--prompt", "x", "--device", "warp-drive"], "unknown device"),
        (["demo", "--prompt", ""], "the prompt is empty (--prompt)"),
        (["demo", "--max-new-tokens", "-2"], "max_new_tokens must be an integer >= 0"),
        (["demo", "--draft", "MISSING"], "does not exist"),
        (["batch", "--input", "ROWS", "--output", "OUT", "--temperature", "-1"], "temperature must be"),
        (["batch", "--input", "ROWS", "--output", "OUT", "--top-p", "2"], "top_p must be"),
        (["batch", "--input", "ROWS", "--output", "OUT", "--max-new-tokens", "-1"], "max_new_tokens must be"),
        (["batch", "--input", "MISSING", "--output", "OUT"], "no such file"),
        (["batch", "--input", "ROWS", "--output", "NO_FOLDER"], "does not exist"),
        (["batch", "--input", "ROWS", "--output", "FOLDER"], "is a folder"),
        (["batch", "--input", "ROWS", "--output", "OUT", "--target", "MISSING"], "does not exist"),
        (["serve", "--max-new-tokens", "-1"], "max_new_tokens must be"),
        (["serve", "--draft", "MISSING"], "does not exist"),
    ],
)
def test_arguments_are_refused_before_any_model_loads(no_loading, files, capsys, argv, message) -> None:
    names = {"MISSING": files["missing"], "ROWS": files["rows"], "OUT": files["out"], "NO_FOLDER": files["no_folder"],
             "FOLDER": files["folder"]}
    line = _one_line_error(capsys, [names.get(a, a) for a in argv])
    assert message in line
    assert not Path(files["out"]).exists()


def test_an_empty_prompt_on_stdin_is_refused(no_loading, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert "the prompt is empty (stdin)" in _one_line_error(capsys, ["generate"])


def test_cuda_on_a_torch_without_cuda_is_one_line(no_loading, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build of torch (simulated, so that the test means the same on a GPU machine): a clear line, not
    torch's ``AssertionError: Torch not compiled with CUDA enabled`` after the weights loaded."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    for command in (["generate", "--prompt", "x"], ["demo"], ["serve"]):
        line = _one_line_error(capsys, [*command, "--device", "cuda"])
        assert "device 'cuda' is not available" in line and "built without CUDA" in line


def test_cuda_without_a_visible_gpu_is_one_line(no_loading, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "no CUDA GPU" in _one_line_error(capsys, ["generate", "--prompt", "x", "--device", "cuda"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "1 CUDA GPU(s)" in _one_line_error(capsys, ["generate", "--prompt", "x", "--device", "cuda:1"])
    from verispec.factory import check_load_options

    for device in ("cuda", "cuda:0"):  # a GPU torch sees passes
        check_load_options("qwen2.5-coder-1.5b", "none", device=device)


def test_a_ray_cluster_s_disks_and_devices_are_not_checked_here(no_loading, files, capsys, monkeypatch) -> None:
    """With --ray-address the workers load from their own disks and GPUs: only the rules that hold everywhere
    are checked on this machine."""
    from types import SimpleNamespace

    import verispec.offline
    from verispec import factory

    real, here = factory.check_load_options, []

    def spy(*args, **kwargs):
        here.append(kwargs["here"])
        return real(*args, **kwargs)

    monkeypatch.setattr(factory, "check_load_options", spy)
    monkeypatch.setattr(verispec.offline, "run_batch",
                        lambda *args, **kwargs: SimpleNamespace(written=1, skipped=0, errors=0, rows=1))
    argv = ["batch", "--input", files["rows"], "--output", files["out"], "--target", files["missing"]]
    assert main([*argv, "--device", "cuda", "--ray-address", "ray://head:10001"]) == 0
    capsys.readouterr()
    assert "does not exist" in _one_line_error(capsys, argv)
    assert here == [False, True]


@pytest.mark.parametrize("argv", [["--debug", "generate"], ["generate", "--debug"], ["demo", "--debug"],
                                  ["batch", "--input", "a", "--output", "b", "--debug"], ["serve", "--debug"],
                                  ["--debug", "serve", "--debug"]])
def test_debug_is_accepted_before_and_after_the_command(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).debug is True


def test_debug_defaults_off_and_shows_the_traceback(no_loading, capsys) -> None:
    assert build_parser().parse_args(["generate"]).debug is False
    assert main(["generate", "--prompt", ""]) == 2
    with pytest.raises(CliError, match="prompt is empty"):
        main(["generate", "--prompt", "", "--debug"])
