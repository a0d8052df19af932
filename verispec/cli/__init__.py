"""The ``verispec`` command line: ``generate`` (stream text), ``demo`` (the README's main command), ``batch`` (an
offline job over a file of prompts), ``serve`` (an OpenAI-compatible HTTP server).

This module holds the parser and ``main``; ``commands`` runs each command, ``common`` holds what they share. Nothing
here imports torch or transformers before a command runs, so that ``--help`` and ``--version`` answer at once."""

from __future__ import annotations

import argparse
import sys

from ..version import __version__
from .commands import cmd_batch, cmd_demo, cmd_generate, cmd_serve
from .common import CliError, log

__all__ = ["CliError", "build_parser", "main"]


def _add_ray_serve_args(srv: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve (README: *Scaling out on Ray*)."""
    srv.add_argument("--replicas", type=int, default=None, metavar="N",
                     help="serve N replicas on Ray Serve, each with its own engine and models (default: one process, "
                          "no Ray)")
    srv.add_argument("--ray-address", default=None, metavar="A",
                     help="join this Ray cluster (default with --replicas: a local Ray instance on loopback)")
    srv.add_argument("--min-replicas", type=int, default=None, metavar="N", help="autoscaling lower bound")
    srv.add_argument("--max-replicas", type=int, default=None, metavar="N", help="autoscaling upper bound")
    srv.add_argument("--cpus-per-replica", type=float, default=1.0, metavar="C")
    srv.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="G")
    srv.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                     help="HTTP requests one replica takes at once; the rest wait in Ray's queue for any replica "
                          "(default: --max-batch-size)")


def _add_model_args(parser: argparse.ArgumentParser, draft_default: str) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="zoo name, HF model folder or .gguf path")
    parser.add_argument("--draft", default=draft_default,
                        help="zoo name, folder, .gguf path, 'ngram', 'suffix' (suffix decoding), 'suffix+MODEL' "
                             "(suffix decoding where it scores high, else the model), 'none', or 'auto' (default for "
                             "most commands: suffix on the llama.cpp backend, where a draft model costs more than it "
                             "saves on a CPU; else qwen2.5-coder-0.5b)")
    parser.add_argument("--suffix-cache-size", type=int, default=None, metavar="N",
                        help="with --draft suffix: earlier responses kept for drafting (all scopes together), the "
                             "oldest evicted first (default 1024; 0: each request's own text only)")
    parser.add_argument("--num-draft-tokens", default="auto", metavar="G",
                        help="most draft tokens per step: an integer (exact; 0 never drafts), 'auto' (the speculation "
                             "controller chooses up to 12, default) or 'heuristic' (transformers' +2/-1; batch's "
                             "default where passes are bitwise, so a rerun decodes the same blocks)")
    parser.add_argument("--backend", choices=["auto", "llama.cpp", "torch"], default="auto",
                        help="what runs the target: llama.cpp (a GGUF on llama.cpp's CPU kernels), torch, or auto "
                             "(default: llama.cpp for a GGUF target on the CPU when llama-cpp-python is installed)")
    parser.add_argument("--bitwise", action="store_true",
                        help="every scoring pass bitwise equal to one-token decoding, so greedy output is the plain "
                             "loop's token for token (probed per build; on several threads llama.cpp allows only "
                             "one-token passes: the target runs alone). Default: exact in distribution, passes on "
                             "the fastest kernels (greedy may differ at near-ties; docs/llamacpp.md)")
    parser.add_argument("--trees", action="store_true",
                        help="draft trees where the target scores them and wider passes cost little (suffix, ngram, "
                             "a draft model; docs/trees.md); off by default: on a 2-core CPU they did not beat chains")
    parser.add_argument("--llama-threads", type=int, default=None, metavar="N",
                        help="threads for llama.cpp's kernels (default: every CPU this process may use; with "
                             "--bitwise, 1 allows bitwise passes of several tokens, docs/llamacpp.md)")
    parser.add_argument("--llama-streams", action=argparse.BooleanOptionalAction, default=None,
                        help="a KV stream of its own per row, --llama-ctx tokens each (the default with --bitwise: "
                             "every row of any batch is bitwise llama.cpp's plain decoding); --no-llama-streams: one "
                             "KV memory of --llama-ctx tokens shared by all rows, admitted by need (the default "
                             "otherwise, as llama-server's slots)")
    parser.add_argument("--no-llama-prompt-cache", dest="llama_prompt_cache", action="store_false", default=None,
                        help="evaluate every prompt whole: by default, in one shared KV memory outside --bitwise, a "
                             "finished row's cells stay until needed and a new prompt starts from the longest prefix "
                             "an earlier or running request of its scope (serve: its API key) left, as llama-server's "
                             "slots do (docs/llamacpp.md)")
    parser.add_argument("--llama-ctx", type=int, default=None, metavar="N",
                        help="llama.cpp's KV memory in tokens: shared by all rows (default 8192 when several rows "
                             "run, else 4096), or with --llama-streams each row's (default 4096, or 65536 shared out "
                             "when more than 16 rows run; about 28 KB a token for the 1.5B target)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--no-fast", dest="fast", action="store_false",
                        help="do not pre-pack the target's linear layers nor quantise the draft")
    parser.add_argument("--draft-quant", choices=["int4", "int8", "none"], default="int4",
                        help="CPU draft weights: int4 (default; int8 where the int4 kernel cannot run), int8 or none")
    parser.add_argument("--cross-tokenizer", choices=["text", "intersection"], default="text",
                        help="a draft with another tokenizer drafts through text (default) or the tokens both "
                             "vocabularies share")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="skip the few seconds of timed steps at load that price draft lengths for the first request")
    parser.add_argument("--stop-drafting", action=argparse.BooleanOptionalAction, default=True,
                        help="with --num-draft-tokens auto and a draft model: end a block early once the draft's "
                             "own confidence in it is below the controller's threshold (default: on)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")


def _add_serve_security_args(srv: argparse.ArgumentParser) -> None:
    """Who may call the server, how much it accepts, how it stops (README: *Running it in production*)."""
    from ..serving.config import ServerOptions

    defaults = ServerOptions()
    srv.add_argument("--api-key", action="append", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (repeat for several keys; also "
                          "VERISPEC_API_KEY, comma-separated)")
    srv.add_argument("--api-key-file", metavar="PATH", help="a file of API keys, one a line (# comments)")
    srv.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    srv.add_argument("--allowed-hosts", action="append", metavar="HOSTS",
                     help="Host header values accepted, comma-separated ('*.example.com' patterns, '*' for any; "
                          "default: loopback names when --host is loopback, else any)")
    srv.add_argument("--docs", action="store_true", help="serve /docs and /redoc (off by default)")
    srv.add_argument("--no-playground", dest="playground", action="store_false",
                     help="do not serve the playground page at /playground (and / redirecting to it)")
    srv.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes, metavar="N",
                     help=f"largest request body, checked while it is read: 413 (default {defaults.max_request_bytes})")
    srv.add_argument("--max-choices", type=int, default=defaults.max_choices, metavar="N",
                     help=f"prompts x n per request: 400 beyond (default {defaults.max_choices})")
    srv.add_argument("--max-request-tokens", type=int, default=defaults.max_request_tokens, metavar="N",
                     help=f"prompts x n x max_tokens per request: 400 beyond (default {defaults.max_request_tokens})")
    srv.add_argument("--max-queued-tokens", type=int, default=defaults.max_queued_tokens, metavar="N",
                     help="the same summed over requests admitted and not finished: 429 with Retry-After beyond "
                          f"(default {defaults.max_queued_tokens})")
    srv.add_argument("--max-rows-per-request", type=int, default=None, metavar="N",
                     help="batch slots one request's choices hold at once (default: half of --max-batch-size)")
    srv.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout, metavar="S",
                     help="seconds in-flight requests get after SIGTERM/SIGINT; then they end with finish_reason "
                          f"'error' (default {defaults.shutdown_timeout:g}); a second signal exits at once")


def _add_sampling_args(parser: argparse.ArgumentParser, temperature_help: str) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)


def _add_debug_arg(parser: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """--debug before or after the command: a sub-command's copy leaves the value alone unless it is given
    (``SUPPRESS``), so ``verispec --debug generate`` and ``verispec generate --debug`` mean the same."""
    parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks on errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec", description="Exact speculative decoding for Hugging Face causal language models.")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    _add_debug_arg(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, func, about: str, draft_default: str = "auto", **defaults):
        """A sub-command running ``func``, with the model flags (its own flags follow; --debug comes last)."""
        cmd = sub.add_parser(name, help=about)
        _add_model_args(cmd, draft_default)
        cmd.set_defaults(func=func, **defaults)
        return cmd

    gen = command("generate", cmd_generate, "generate text, streamed as it is accepted",
                  llama_rows=1)  # one prompt: KV memory for one row
    gen.add_argument("--prompt", help="prompt text (or --prompt-file, or stdin)")
    gen.add_argument("--prompt-file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--audio", metavar="FILE", help="a speech-to-text target (Whisper): transcribe this sound file "
                                                     "(WAV, FLAC, OGG; at most 30 s) instead of a prompt")
    _add_sampling_args(gen, "0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers': prompt and output")
    gen.add_argument("--min-tokens", type=int, default=0, help="EOS masked before this many tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    demo = command("demo", cmd_demo, "real models on a copy-edit: the plain loop vs speculative, timed side by side, "
                   "whether the outputs are identical, the speed-up where tokens were drafted", "suffix",
                   max_new_tokens=160, llama_rows=1)
    demo.add_argument("--prompt", default=None, help="a code prompt, completed as it is (default: a copy-edit "
                                                     "instruction, in the model's chat template)")

    bat = command("batch", cmd_batch, "offline job: complete every row of a JSONL/Parquet file (resumable; Ray Data)",
                  num_draft_tokens=None)  # offline.batch_schedule: timing-free where passes are bitwise
    bat.add_argument("--input", required=True, help="JSONL or .parquet rows: prompt or messages, max_tokens, "
                                                    "temperature, top_p, top_k, seed; other fields kept as they are")
    bat.add_argument("--output", required=True, help="JSONL: the input rows plus the completions (rows already "
                                                     "there are skipped, so a killed job resumes)")
    bat.add_argument("--workers", type=int, default=None, metavar="N",
                     help="Ray Data actors, each holding the models (default: decode in-process)")
    bat.add_argument("--batch-size", type=int, default=16, metavar="B",
                     help="consecutive input rows decoded together (16); keep it when resuming")
    _add_sampling_args(bat, "for rows without one: 0 = greedy (default)")
    bat.add_argument("--seed", type=int, default=None,
                     help="job seed: a sampled row without its own seed samples with one derived from it and its index")
    bat.add_argument("--ray-address", default=None, metavar="A",
                     help="a Ray cluster to run the workers on (default: a local Ray instance on loopback)")
    bat.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C")
    bat.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G")
    bat.add_argument("--no-progress", action="store_true", help="no progress bar")

    srv = command("serve", cmd_serve, "OpenAI-compatible HTTP server with continuous batching",
                  max_new_tokens=None)  # per request: max_tokens, else OpenAI's defaults
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch-size", type=int, default=32, metavar="B", help="rows decoded together (32)")
    srv.add_argument("--model-name", default=None,
                     help="the model id clients send (default: the zoo name or Hub id, or the folder's or file's own "
                          "name: never a path)")
    srv.add_argument("--max-context", type=int, default=None, metavar="N",
                     help="prompt + generated tokens per request (default: the model's maximum length)")
    srv.add_argument("--log-level", default="info", help="uvicorn's log level (info)")
    srv.add_argument("--suffix-scope", choices=["global", "key", "request"], default=None,
                     help="with --draft suffix: whose earlier responses a request's drafts may come from: every "
                          "request's, its API key's, or none (default: key when API keys are set, else global)")
    _add_serve_security_args(srv)
    _add_ray_serve_args(srv)
    for cmd in (gen, demo, bat, srv):
        _add_debug_arg(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except Exception as error:  # one clear line unless --debug
        if args.debug:
            raise
        message = str(error) if isinstance(error, (CliError, ValueError)) else f"{type(error).__name__}: {error}"
        print(f"verispec: error: {message}", file=sys.stderr)
        return 2
