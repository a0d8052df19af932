"""The ``verispec`` command line: ``generate`` (stream text), ``demo`` (the README's main command), ``batch`` (an
offline job over a file of prompts), ``serve`` (an OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable

from .version import __version__
# plain Python: nothing here imports torch or transformers before a command runs, so that --help and --version
# answer at once (the decoder's modules are imported inside commands)
from .text import ChatTemplateError, TextState, chat_prompt_ids

DEMO_PROMPT = (
    "def merge_sorted(left: list[int], right: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
)


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _log(message: str) -> None:
    print(f"[verispec] {message}", file=sys.stderr, flush=True)


def build_decoder(args: argparse.Namespace, progress: Callable[[str], None] = _log):
    """Load the target (and draft) named by ``args`` with the library factory; returns ``(decoder, tokenizer)``."""
    from .factory import load
    from .models import LoadError

    gamma = _gamma_arg(args.num_draft_tokens)
    try:
        return load(args.target, args.draft, device=args.device, dtype=args.dtype, fast=args.fast,
                    draft_quant=getattr(args, "draft_quant", "int4"), progress=progress, num_draft_tokens=gamma,
                    cross_tokenizer=getattr(args, "cross_tokenizer", "text"),
                    stop_drafting=getattr(args, "stop_drafting", True), **_suffix_options(args))
    except LoadError as error:
        raise CliError(str(error)) from error


def _suffix_options(args: argparse.Namespace) -> dict:
    """``load``'s suffix decoding options from the command line (its cache size; serve's scope)."""
    return {"suffix_cache_size": getattr(args, "suffix_cache_size", None),
            "suffix_scope": getattr(args, "suffix_scope", None) or "global"}


def _int_arg(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CliError(f"--num-draft-tokens must be an integer, 'auto' or 'heuristic', got {value!r}") from None


# The sampling flags of each command, by their ``SamplingParams`` names (``generate`` takes the same keywords).
GENERATE_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens")
BATCH_SAMPLING = ("temperature", "top_k", "top_p")  # the defaults of rows that give none (``JobDefaults``)


def check_request_args(args: argparse.Namespace, sampling_names: tuple[str, ...] = ()) -> None:
    """Refuse sampling settings and a token budget that generation would refuse, before any model loads: the
    library's own rules (``SamplingParams``, ``validate_request``), with the model-free half of the limits (one
    token id, no length limit); the decoder checks again against its models. Raises ``ValueError``."""
    from .core.sampling import SamplingParams
    from .decode.requests import ModelLimits, validate_request

    sampling = SamplingParams(**{name: getattr(args, name) for name in sampling_names})
    if args.max_new_tokens is not None:
        validate_request(ModelLimits(vocab_size=1, input_limit=1, max_positions=None), [[0]], sampling,
                         args.max_new_tokens, seed=getattr(args, "seed", None))


def check_model_args(args: argparse.Namespace, here: bool = True) -> None:
    """Refuse what ``verispec.load`` would refuse, before any model loads: dtype, device (and, with ``here``,
    whether this machine has it), the draft options, and the target and draft names (``here``: on this
    machine's disk or in the zoo; ``here=False`` when Ray workers load the models elsewhere)."""
    from .models import LoadError
    from .factory import check_load_options

    try:
        check_load_options(args.target, args.draft, device=args.device, dtype=args.dtype,
                           draft_quant=args.draft_quant, cross_tokenizer=args.cross_tokenizer, here=here,
                           num_draft_tokens=_gamma_arg(args.num_draft_tokens), stop_drafting=args.stop_drafting,
                           **_suffix_options(args))
    except LoadError as error:
        raise CliError(str(error)) from error


def _gamma_arg(value: str) -> int | str:
    return value if value in ("auto", "heuristic") else _int_arg(value)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        try:
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
        except ChatTemplateError as error:
            raise CliError(f"--chat: {error}") from error
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise CliError("the prompt is empty after tokenisation")
    return list(ids)


class TextStream:
    """Writes a completion's text as its tokens arrive (``generate``'s ``on_tokens``); ``close()`` writes the
    rest and returns the whole text. Without ``out`` it only collects the text."""

    def __init__(self, tokenizer, prompt_ids: list[int], out=None) -> None:
        self.state, self.out = TextState(tokenizer, prompt_ids), out

    def __call__(self, row: int, tokens: list[int]) -> None:
        self._write(self.state.add(tokens))

    def close(self) -> str:
        self._write(self.state.flush())
        return self.state.text

    def _write(self, text: str) -> None:
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()


def generate_streamed(decoder, tokenizer, prompt_ids: list[int], out, **options):
    """``decoder.generate`` on one prompt, its text written to ``out`` (if given) as the tokens come; returns
    the output and the whole text."""
    stream = TextStream(tokenizer, prompt_ids, out)
    result = decoder.generate([prompt_ids], on_tokens=stream, **options)
    return result, stream.close()


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt, --prompt-file or stdin; an empty one is refused here, before loading."""
    if args.prompt is not None:
        text, source = args.prompt, "--prompt"
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                text, source = handle.read(), f"--prompt-file {args.prompt_file}"
        except OSError as error:
            raise CliError(f"cannot read --prompt-file: {error}") from error
    elif sys.stdin.isatty():
        raise CliError("no prompt: give --prompt, --prompt-file, or pipe text on stdin")
    else:
        text, source = sys.stdin.read(), "stdin"
    if not text:
        raise CliError(f"the prompt is empty ({source})")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from .models import eos_token_ids

    prompt = read_prompt(args)
    check_request_args(args, GENERATE_SAMPLING)
    check_model_args(args)
    decoder, tokenizer = build_decoder(args, _log if not args.json else (lambda m: None))
    prompt_ids = encode_prompt(tokenizer, prompt, args.chat)
    started = time.perf_counter()
    out, text = generate_streamed(
        decoder, tokenizer, prompt_ids, None if args.json else sys.stdout, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_token_id=eos_token_ids(tokenizer, decoder.target_model), seed=args.seed, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
    )
    wall = time.perf_counter() - started
    stats = out.stats
    if args.json:
        print(json.dumps({
            "prompt_tokens": len(prompt_ids), "tokens": out.tokens[0], "text": text,
            "finish_reason": out.finish_reasons[0], "seed": out.seed, "wall_time_s": wall,
            "tokens_per_second": len(out.tokens[0]) / wall if wall > 0 else 0.0, "stats": stats.to_dict(),
        }))
    else:
        print()
        _log(f"{stats.generated_tokens} tokens in {wall:.2f} s ({stats.generated_tokens / wall:.2f} tok/s); "
             f"acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_row_step:.2f} tokens per target pass; "
             f"finish: {out.finish_reasons[0]}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the real pair on a code prompt: target alone, then speculative; show both agree and the speed-up.
    Standard output holds each text under its label, then the summary, so that it reads the same in a file."""
    from .models import eos_token_ids

    prompt = DEMO_PROMPT if args.prompt is None else args.prompt
    if not prompt:
        raise CliError("the prompt is empty (--prompt)")
    check_request_args(args)
    check_model_args(args)
    _log(f"loading target {args.target} and draft {args.draft} (first run installs and verifies them; "
         "a few minutes)")
    decoder, tokenizer = build_decoder(args)
    prompt_ids = encode_prompt(tokenizer, prompt, chat=False)
    eos = eos_token_ids(tokenizer, decoder.target_model)
    common = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "eos_token_id": eos}
    _label("prompt")
    print(prompt, end="" if prompt.endswith("\n") else "\n", flush=True)
    _log("warm-up pass")
    decoder.generate([prompt_ids], max_new_tokens=4, draft=None)
    _label("target alone (greedy)")
    alone, _ = generate_streamed(decoder, tokenizer, prompt_ids, sys.stdout, draft=None, **common)
    print()
    _label(f"speculative (greedy, draft length {decoder.num_draft_tokens})")
    spec, _ = generate_streamed(decoder, tokenizer, prompt_ids, sys.stdout, **common)
    print()
    same = alone.tokens == spec.tokens
    speedup = alone.stats.total_time_s / spec.stats.total_time_s
    _label("summary")
    print(json.dumps({
        "identical_output": same,
        "tokens": len(spec.tokens[0]),
        "target_alone_tokens_per_s": round(alone.stats.tokens_per_second, 3),
        "speculative_tokens_per_s": round(spec.stats.tokens_per_second, 3),
        "speedup": round(speedup, 3),
        "acceptance_rate": round(spec.stats.acceptance_rate, 3),
        "tokens_per_target_pass": round(spec.stats.tokens_per_row_step, 3),
    }, indent=2))
    if not same:
        raise CliError("outputs differ: this is a bug, please report it with the command line above")
    return 0


def _label(title: str) -> None:
    """A section heading on standard output, on a line of its own (the demo's texts are read from a file too)."""
    print(f"=== {title} ===", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API (completions, chat, streaming, metrics) with continuous batching."""
    try:
        from .serving.config import ServerOptions, default_allowed_hosts, default_model_name, read_api_keys
        from .serving.lifecycle import serve
    except ImportError as error:
        raise CliError(f"serving needs fastapi, uvicorn and prometheus_client (pip install 'verispec[server]'): "
                       f"{error}") from error
    options = ServerOptions(  # checked before the models load
        api_keys=read_api_keys(args.api_key or (), args.api_key_file), metrics_public=args.metrics_public,
        allowed_hosts=default_allowed_hosts(args.host, args.allowed_hosts), docs=args.docs,
        playground=args.playground,
        max_request_bytes=args.max_request_bytes, max_choices=args.max_choices,
        max_request_tokens=args.max_request_tokens, max_queued_tokens=args.max_queued_tokens,
        shutdown_timeout=args.shutdown_timeout)
    if args.suffix_scope is None:  # one tenant's answers never shape another's drafts
        args.suffix_scope = "key" if options.api_keys else "global"
    check_request_args(args)
    check_model_args(args, here=args.ray_address is None)  # a cluster's workers load from their own disks
    if args.replicas is not None or args.ray_address is not None:
        return _serve_on_ray(args, options)
    decoder, tokenizer = build_decoder(args)
    code = serve(decoder, tokenizer, model_name=args.model_name or default_model_name(args.target), host=args.host,
                 port=args.port, max_batch_size=args.max_batch_size, max_rows_per_request=args.max_rows_per_request,
                 max_context=args.max_context, default_max_tokens=args.max_new_tokens, options=options,
                 log_level=args.log_level, say=_log)
    if code:  # a second signal: exit now, without the seconds the interpreter spends tearing the models down
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_batch(args: argparse.Namespace) -> int:
    """An offline job: every row of --input generated into --output (resumable), in-process or on Ray Data."""
    from .offline import JobDefaults, run_batch

    _check_batch_files(args.input, args.output)
    check_request_args(args, BATCH_SAMPLING)
    check_model_args(args, here=args.ray_address is None)  # a cluster's workers load from their own disks
    gamma = _gamma_arg(args.num_draft_tokens)
    defaults = JobDefaults(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed)
    summary = run_batch(args.target, args.draft, input_path=args.input, output_path=args.output, workers=args.workers,
                        batch_size=args.batch_size, defaults=defaults, progress=not args.no_progress,
                        ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker,
                        gpus_per_worker=args.gpus_per_worker, device=args.device, dtype=args.dtype, fast=args.fast,
                        draft_quant=args.draft_quant, cross_tokenizer=args.cross_tokenizer, num_draft_tokens=gamma,
                        stop_drafting=args.stop_drafting, **_suffix_options(args))
    _log(f"{summary.written} rows written to {args.output} ({summary.skipped} were already there, "
         f"{summary.errors} errors, {summary.rows} in the input)")
    return 0


def _check_batch_files(input_path: str, output_path: str) -> None:
    """The job's files, before the models load: --input is a file; --output is no folder and its folder exists
    (the job reads the input, and appends to the output, only in this process)."""
    if not os.path.isfile(input_path):
        raise CliError(f"--input {input_path}: no such file")
    if os.path.isdir(output_path):
        raise CliError(f"--output {output_path}: is a folder (give a file name)")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise CliError(f"--output {output_path}: the folder {folder} does not exist")


def _serve_on_ray(args: argparse.Namespace, options) -> int:
    """``serve --replicas N``: the same app on Ray Serve; each replica loads the models itself."""
    try:
        from .serving.ray import ReplicaSpec, Scaling, deploy
    except ImportError as error:
        raise CliError(f"--replicas and --ray-address need Ray Serve (pip install 'verispec[ray]'): {error}") from error
    from .serving.config import default_model_name

    gamma = _gamma_arg(args.num_draft_tokens)
    spec = ReplicaSpec(
        target=args.target, draft=args.draft, model_name=args.model_name or default_model_name(args.target),
        load_options={"device": args.device, "dtype": args.dtype, "fast": args.fast, "draft_quant": args.draft_quant,
                      "cross_tokenizer": args.cross_tokenizer, "num_draft_tokens": gamma,
                      "stop_drafting": args.stop_drafting, **_suffix_options(args)},
        max_batch_size=args.max_batch_size, max_rows_per_request=args.max_rows_per_request,
        max_context=args.max_context, default_max_tokens=args.max_new_tokens, options=options)
    scaling = Scaling(replicas=args.replicas or 1, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                      max_ongoing_requests=args.max_ongoing_requests)
    _log(f"deploying {scaling.replicas} replica(s) of {spec.model_name} on Ray Serve "
         f"({args.ray_address or 'a local Ray instance'}); http://{args.host}:{args.port}/v1")
    deploy(spec, scaling, host=args.host, port=args.port, ray_address=args.ray_address)
    return 0


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
                             "(suffix decoding where it scores high, else the model) or 'none'")
    parser.add_argument("--suffix-cache-size", type=int, default=None, metavar="N",
                        help="with --draft suffix: earlier responses kept for drafting (all scopes together), the "
                             "oldest evicted first (default 1024; 0: each request's own text only)")
    parser.add_argument("--num-draft-tokens", default="auto", metavar="G",
                        help="most draft tokens per step: an integer (exact; 0 never drafts), 'auto' (the speculation "
                             "controller chooses up to 12, default) or 'heuristic'")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--no-fast", dest="fast", action="store_false",
                        help="do not pre-pack the target's linear layers nor quantise the draft")
    parser.add_argument("--draft-quant", choices=["int4", "int8", "none"], default="int4",
                        help="CPU draft weights: int4 (default; int8 where the int4 kernel cannot run), int8 or none")
    parser.add_argument("--cross-tokenizer", choices=["text", "intersection"], default="text",
                        help="a draft with another tokenizer drafts through text (default) or the tokens both "
                             "vocabularies share")
    parser.add_argument("--stop-drafting", action=argparse.BooleanOptionalAction, default=True,
                        help="with --num-draft-tokens auto and a draft model: end a block early once the draft's "
                             "own confidence in it is below the controller's threshold (default: on)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")


def _add_serve_security_args(srv: argparse.ArgumentParser) -> None:
    """Who may call the server, how much it accepts, how it stops (README: *Running it in production*)."""
    from .serving.config import ServerOptions

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

    gen = sub.add_parser("generate", help="generate text, streamed as it is accepted")
    _add_model_args(gen, draft_default="qwen2.5-coder-0.5b")
    gen.add_argument("--prompt", help="prompt text (or --prompt-file, or stdin)")
    gen.add_argument("--prompt-file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(gen, "0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the generated tokens")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers': prompt and output")
    gen.add_argument("--min-tokens", type=int, default=0, help="EOS masked before this many tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_debug_arg(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="real model pair: target alone vs speculative, identical output, speed-up")
    _add_model_args(demo, draft_default="qwen2.5-coder-0.5b")
    demo.set_defaults(max_new_tokens=64)
    demo.add_argument("--prompt", default=None, help="a code prompt (default: a Python function header)")
    _add_debug_arg(demo)
    demo.set_defaults(func=cmd_demo)

    bat = sub.add_parser("batch", help="offline job: complete every row of a JSONL/Parquet file (resumable; Ray Data)")
    _add_model_args(bat, draft_default="qwen2.5-coder-0.5b")
    bat.set_defaults(num_draft_tokens="heuristic")  # timing-free: every run decodes the same blocks
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
    _add_debug_arg(bat)
    bat.set_defaults(func=cmd_batch)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_model_args(srv, draft_default="qwen2.5-coder-0.5b")
    srv.set_defaults(max_new_tokens=None)  # per request: max_tokens, else OpenAI's defaults
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
    _add_debug_arg(srv)
    srv.set_defaults(func=cmd_serve)
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
        _log("interrupted")
        return 130
    except Exception as error:  # one clear line unless --debug
        if args.debug:
            raise
        message = str(error) if isinstance(error, (CliError, ValueError)) else f"{type(error).__name__}: {error}"
        print(f"verispec: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
