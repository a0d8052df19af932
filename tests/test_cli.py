"""The ``verispec`` command line on tiny model folders (no downloads)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tiny_models import save_word_model
from verispec.cli import build_parser, main

WORDS = ["<unk>", "<s>", "</s>"] + [
    "def", "return", "x", "y", "(", ")", ":", "+", "-", "1", "2", "if", "else", "for", "in", "print", "hello", "world",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-models")
    return {
        "target": save_word_model(root / "target", WORDS, 0),
        "draft": save_word_model(root / "draft", WORDS, 1),
        "other": save_word_model(root / "other", WORDS[:-2] + ["foo", "bar"], 2),
    }


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_equals_the_target_alone(models, capsys) -> None:
    common = ["generate", "--target", models["target"], "--prompt", "def x ( y ) :", "--max-new-tokens", "9", "--json"]
    code, out, _ = run(capsys, *common, "--draft", models["draft"], "--num-draft-tokens", "3")
    assert code == 0
    spec = json.loads(out)
    code, out, _ = run(capsys, *common, "--draft", "none")
    alone = json.loads(out)
    assert spec["tokens"] == alone["tokens"] and 1 <= len(spec["tokens"]) <= 9
    assert spec["stats"]["draft_tokens"] > 0 and alone["stats"]["draft_tokens"] == 0
    assert set(spec) >= {"text", "tokens", "stats", "wall_time_s", "tokens_per_second", "finish_reason"}


@pytest.mark.parametrize("quant, message", [("int4", "int8 weights"), ("int8", "int8 weights"), ("none", None)])
def test_draft_quantisation_choices_keep_the_output(models, capsys, quant, message) -> None:
    """Hidden size 32 is not a multiple of the int4 group size (64): int4 falls back to int8, and says so."""
    common = ["generate", "--target", models["target"], "--prompt", "def x ( y ) :", "--max-new-tokens", "9", "--json"]
    code, _, err = run(capsys, *common[:-1], "--draft", models["draft"], "--draft-quant", quant)  # progress shown
    assert code == 0
    assert (message in err) if message else ("int8 weights" not in err and "int4 weights" not in err)
    code, out, _ = run(capsys, *common, "--draft", models["draft"], "--draft-quant", quant)
    code, alone, _ = run(capsys, *common, "--draft", "none")
    assert json.loads(out)["tokens"] == json.loads(alone)["tokens"]


def test_stop_drafting_flag_keeps_the_output(models, capsys) -> None:
    common = ["generate", "--target", models["target"], "--prompt", "def x ( y ) :", "--max-new-tokens", "12", "--json"]
    code, alone, _ = run(capsys, *common, "--draft", "none")
    for flag in ("--stop-drafting", "--no-stop-drafting"):
        code, out, _ = run(capsys, *common, "--draft", models["draft"], flag)
        assert code == 0 and json.loads(out)["tokens"] == json.loads(alone)["tokens"]
    assert build_parser().parse_args(["generate"]).stop_drafting  # on by default
    assert not build_parser().parse_args(["serve", "--no-stop-drafting"]).stop_drafting


def test_generate_streams_text_and_reports(models, capsys) -> None:
    argv = ["generate", "--target", models["target"], "--draft", "ngram", "--prompt", "x + 1 x + 1 x +",
            "--max-new-tokens", "6", "--min-tokens", "6", "--temperature", "0.8", "--seed", "3"]
    code, streamed, err = run(capsys, *argv)
    assert code == 0
    assert "tok/s" in err and "acceptance" in err
    code, out, _ = run(capsys, *argv, "--json")
    result = json.loads(out)
    assert result["text"].strip() and streamed.strip() == result["text"].strip()  # same seed, same text


def test_prompt_from_stdin(models, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world"))
    code, out, _ = run(capsys, "generate", "--target", models["target"], "--draft", "none", "--max-new-tokens", "3",
                       "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target", "/no/such/model"], "does not exist"),
        (["--target", "not-a-zoo-name"], "known zoo models"),
        (["--dtype", "float13"], "dtype"),
        (["--num-draft-tokens", "many"], "--num-draft-tokens"),
        (["--num-draft-tokens", "-1"], "num_draft_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--llama-threads", "0"], "--llama-threads"),
        (["--llama-ctx", "10"], "--llama-ctx"),
    ],
)
def test_errors_are_one_line_without_traceback(models, capsys, argv, message) -> None:
    argv = [models["other"] if a == "OTHER" else a for a in argv]
    base = {"--target": models["target"], "--draft": models["draft"]}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    flat = [x for pair in base.items() for x in pair]
    code, _, err = run(capsys, "generate", *flat, "--prompt", "def x", "--max-new-tokens", "2")
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) >= 1 and err.strip().splitlines()[-1].startswith("verispec: error:")


def test_a_draft_with_another_tokenizer_drafts_through_text(models, capsys) -> None:
    code, out, _ = run(capsys, "generate", "--target", models["target"], "--draft", models["other"], "--prompt",
                       "def x", "--max-new-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 2


def test_debug_shows_the_traceback(models) -> None:
    result = subprocess.run([sys.executable, "-m", "verispec.cli", "--debug", "generate", "--target", "/no/such",
                             "--prompt", "x"], capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_version_and_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and "verispec" in capsys.readouterr().out
    assert main([]) == 0 and "generate" in capsys.readouterr().out


def test_serve_options_are_checked_before_the_models_load(tmp_path, capsys, monkeypatch) -> None:
    """Wrong limits or an unreadable key file fail at once, in one line, without loading anything."""
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    for argv, message in [
        (["--max-queued-tokens", "10", "--max-request-tokens", "100"], "max_queued_tokens"),
        (["--max-choices", "0"], "max_choices"),
        (["--api-key-file", str(tmp_path / "missing")], "cannot read the API key file"),
        (["--api-key", "two words"], "printable ASCII"),
        (["--shutdown-timeout", "-1"], "shutdown_timeout"),
    ]:
        code, _, err = run(capsys, "serve", "--target", "/no/such/model", *argv)
        assert code == 2 and message in err and "does not exist" not in err, err


def test_serve_flags(monkeypatch) -> None:
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "--allowed-hosts", "x.org,y.org",
                                      "--metrics-public", "--docs", "--max-rows-per-request", "3"])
    assert args.api_key == ["a", "b"] and args.allowed_hosts == ["x.org,y.org"] and args.metrics_public and args.docs
    assert args.max_rows_per_request == 3
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_request_bytes, defaults.max_choices, defaults.shutdown_timeout) == (2**20, 32, 30.0)
    assert not defaults.docs and not defaults.metrics_public and defaults.model_name is None


def test_generate_processor_flags_are_applied_and_exact(models, capsys) -> None:
    common = ["generate", "--target", models["target"], "--prompt", "def x ( y ) :", "--max-new-tokens", "9", "--json"]
    flags = ["--repetition-penalty", "2.0", "--presence-penalty", "1.5", "--min-tokens", "9"]
    _, plain, _ = run(capsys, *common, "--draft", "none")
    code, spec, _ = run(capsys, *common, *flags, "--draft", models["draft"], "--num-draft-tokens", "3")
    _, alone, _ = run(capsys, *common, *flags, "--draft", "none")
    assert code == 0 and json.loads(spec)["tokens"] == json.loads(alone)["tokens"] != json.loads(plain)["tokens"]
    assert len(json.loads(spec)["tokens"]) == 9  # min_tokens: no EOS before the budget


def test_demo_labels_its_texts_on_stdout(models, capsys) -> None:
    """Redirected to a file, the demo's output still says which text is which: each label on stdout, on a line of
    its own, before its text; the summary last."""
    code, out, err = run(capsys, "demo", "--target", models["target"], "--draft", models["draft"], "--prompt",
                         "def x ( y ) :", "--max-new-tokens", "6", "--num-draft-tokens", "3")
    assert code == 0, err
    lines = out.splitlines()
    labels = [line for line in lines if line.startswith("=== ")]
    assert labels == ["=== prompt ===", "=== plain loop (target alone, greedy) ===",
                      "=== speculative (greedy, draft length 3) ===", "=== summary ==="]
    sections = {}
    for label, start in ((line, i) for i, line in enumerate(lines) if line in labels):
        rest = lines[start + 1:]
        sections[label] = "\n".join(rest[:next((i for i, line in enumerate(rest) if line in labels), len(rest))])
    assert sections["=== prompt ==="] == "def x ( y ) :"
    assert sections["=== plain loop (target alone, greedy) ==="].strip()
    assert sections["=== plain loop (target alone, greedy) ==="] == sections["=== speculative (greedy, draft length 3) ==="]
    summary = json.loads(sections["=== summary ==="])
    assert summary["identical_output"] is True and 1 <= summary["tokens"] <= 6
    assert summary["mode"] == "exact-in-distribution" and summary["drafted_tokens"] > 0
    assert isinstance(summary["speedup"], float) and "not_drafted_because" not in summary
    assert "===" not in err  # the labels are not (also) on stderr


@pytest.mark.parametrize("bitwise", [False, True])
def test_demo_prints_no_speed_up_when_nothing_was_drafted(models, capsys, bitwise) -> None:
    """With nothing drafted the demo times the same loop twice: it prints no speed-up, says why, and names the mode
    in force (before issue 41 it printed a "speedup" of the target alone against itself)."""
    from types import SimpleNamespace

    from verispec.models.pass_cost import priced_out_reason

    flags = ["--bitwise"] if bitwise else []
    code, out, err = run(capsys, "demo", "--target", models["target"], "--draft", "none", "--prompt", "def x ( y ) :",
                         "--max-new-tokens", "6", *flags)
    assert code == 0, err
    summary = json.loads(out.split("=== summary ===", 1)[1])
    assert summary["speedup"] is None and summary["drafted_tokens"] == 0
    # In the bitwise mode this build's torch kernels score only one-token passes bitwise: no draft could pay.
    assert summary["not_drafted_because"] == ("no draft (--draft none)" if not bitwise else
                                              "no draft was loaded: " + priced_out_reason(SimpleNamespace(pass_cap=1)))
    assert summary["mode"] == ("bitwise" if bitwise else "exact-in-distribution")
    assert summary["identical_output"] is True


def test_llama_threads_flag_becomes_the_backends_settings() -> None:
    """``--llama-threads N`` reaches ``verispec.load`` as ``LlamaSettings(n_threads=N)``; absent, the defaults
    for one row (``generate`` decodes one prompt)."""
    from verispec.cli.common import llama_settings
    from verispec.models.llamacpp import LlamaSettings

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--llama-threads", "1"])
    assert llama_settings(args) == LlamaSettings(n_threads=1, n_seq_max=1)
    assert llama_settings(parser.parse_args(["generate", "--prompt", "x"])) == LlamaSettings(n_seq_max=1)


def test_llama_rows_follow_each_commands_batch() -> None:
    """llama.cpp holds as many rows as the command decodes at once: one for ``generate`` and ``demo``,
    ``--max-batch-size`` for ``serve``, ``--batch-size`` for ``batch``; by default in one memory they share (4096
    cells for one row, 8192 for several); with ``--bitwise`` a KV stream each (4096, or 65536 cells shared out
    over more than 16 rows)."""
    from verispec.cli.common import llama_settings

    parser = build_parser()
    rows = {
        ("generate", "--prompt", "x"): (1, 4096, 4096), ("demo",): (1, 4096, 4096), ("serve",): (32, 8192, 2048),
        ("serve", "--max-batch-size", "8"): (8, 8192, 4096),
        ("batch", "--input", "x.jsonl", "--output", "y.jsonl"): (16, 8192, 4096),
        ("batch", "--input", "x.jsonl", "--output", "y.jsonl", "--batch-size", "64"): (64, 8192, 1024),
    }
    for argv, (count, shared_ctx, stream_ctx) in rows.items():
        settings = llama_settings(parser.parse_args(list(argv)))
        assert (settings.n_seq_max, settings.per_row_streams(), settings.row_ctx()) == (count, False, shared_ctx)
        bitwise = llama_settings(parser.parse_args([*argv, "--bitwise"]))
        assert (bitwise.bitwise, bitwise.per_row_streams(), bitwise.row_ctx()) == (True, True, stream_ctx), argv


def test_llama_ctx_flag_sizes_the_kv_memory() -> None:
    """``--llama-ctx N`` reaches ``verispec.load`` as ``LlamaSettings(n_ctx=N)``, with the threads if given too;
    the other settings keep the backend's defaults; ``--no-llama-streams`` shares one memory among the rows."""
    from verispec.cli.common import llama_settings
    from verispec.models.llamacpp import LlamaSettings

    parser = build_parser()
    args = parser.parse_args(["serve", "--llama-ctx", "16384"])
    assert llama_settings(args) == LlamaSettings(n_ctx=16384, n_seq_max=32)
    assert llama_settings(args).kv_cells() == 16384  # shared by the rows
    assert llama_settings(parser.parse_args(["serve", "--llama-ctx", "16384", "--bitwise"])).kv_cells() == 16384 * 32
    both = llama_settings(parser.parse_args(["batch", "--llama-ctx", "8192", "--llama-threads", "1",
                                             "--input", "x.jsonl", "--output", "y.jsonl"]))
    assert (both.n_ctx, both.n_threads, both.repack) == (8192, 1, LlamaSettings().repack)
    shared = llama_settings(parser.parse_args(["serve", "--no-llama-streams", "--llama-ctx", "16384"]))
    assert (shared.streams, shared.row_ctx(), shared.kv_cells()) == (False, 16384, 16384)
    served = llama_settings(parser.parse_args(["serve", "--llama-streams", "--max-batch-size", "8"]))
    assert (served.streams, served.n_seq_max) == (True, 8)
