"""The ``verispec`` commands: ``generate`` (stream text), ``demo`` (target alone vs speculative on a real pair),
``batch`` (an offline job over a file of prompts), ``serve`` (an OpenAI-compatible HTTP server, alone or on Ray
Serve). Each takes the parsed arguments and returns the exit code; the decoder's modules are imported inside."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .common import (
    BATCH_SAMPLING,
    GENERATE_SAMPLING,
    CliError,
    build_decoder,
    check_model_args,
    check_request_args,
    encode_prompt,
    generate_streamed,
    load_options,
    log,
    read_prompt,
)

# The demo's default: a copy-edit, the work where speculation pays (the answer copies most of its prompt).
DEMO_PROMPT = (
    "Add type hints to this Python function and output the whole function, nothing else.\n\n"
    "```python\n"
    "def moving_average(values, window):\n"
    '    """Return the averages of every run of window consecutive values."""\n'
    "    if window <= 0:\n"
    '        raise ValueError("window must be positive")\n'
    "    averages = []\n"
    "    total = 0.0\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n"
    "        if index >= window:\n"
    "            total -= values[index - window]\n"
    "        if index >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n"
    "```\n"
)


def cmd_generate(args: argparse.Namespace) -> int:
    from ..models import eos_token_ids

    if args.audio is not None and (args.prompt is not None or args.prompt_file is not None or args.chat):
        raise CliError("--audio is the input: give no --prompt, --prompt-file or --chat with it")
    prompt = read_prompt(args) if args.audio is None else None
    check_request_args(args, GENERATE_SAMPLING)
    check_model_args(args)
    progress = log if not args.json else (lambda m: None)
    decoder, tokenizer = build_decoder(args, progress)
    prompt_ids = _model_input(args, decoder, tokenizer, prompt, progress)
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
            "prompt_tokens": 0 if args.audio is not None else len(prompt_ids), "tokens": out.tokens[0], "text": text,
            "finish_reason": out.finish_reasons[0], "seed": out.seed, "wall_time_s": wall,
            "tokens_per_second": len(out.tokens[0]) / wall if wall > 0 else 0.0, "stats": stats.to_dict(),
        }))
    else:
        print()
        log(f"{stats.generated_tokens} tokens in {wall:.2f} s ({stats.generated_tokens / wall:.2f} tok/s); "
             f"acceptance {stats.acceptance_rate:.0%}, {stats.tokens_per_target_pass:.2f} tokens per target pass; "
             f"finish: {out.finish_reasons[0]}")
    return 0


def _model_input(args: argparse.Namespace, decoder, tokenizer, prompt: str | None, progress):
    """What ``generate`` decodes from: the prompt's token ids (an encoder-decoder's source, as it is), or the
    ``--audio`` file's input features for a speech target."""
    speech, seq2seq = decoder.limits.source_features is not None, decoder.limits.decoder_prompt is not None
    if args.audio is None and speech:
        raise CliError(f"{args.target} is a speech-to-text model: give --audio FILE")
    if args.audio is not None:
        if not speech:
            raise CliError(f"--audio needs a speech-to-text target (Whisper); {args.target} reads text")
        from ..models.audio import audio_features, load_feature_extractor

        try:
            return audio_features(args.audio, load_feature_extractor(args.target, progress))
        except ValueError as error:
            raise CliError(str(error)) from error
    if args.chat and seq2seq:
        raise CliError("--chat: an encoder-decoder reads its input as it is (it has no chat template)")
    return encode_prompt(tokenizer, prompt, args.chat)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the real models on a copy-edit: the plain loop (the target alone, same backend), then speculative, timed
    side by side; show whether the outputs are identical and, only where tokens were drafted, the speed-up.
    Standard output holds each text under its label, then the summary, so that it reads the same in a file."""
    from ..models import eos_token_ids

    prompt = DEMO_PROMPT if args.prompt is None else args.prompt
    if not prompt:
        raise CliError("the prompt is empty (--prompt)")
    check_request_args(args)
    check_model_args(args)
    log(f"loading target {args.target} and draft {args.draft} (first run installs and verifies them; "
         "a few minutes)")
    decoder, tokenizer = build_decoder(args)
    chat = args.prompt is None and getattr(tokenizer, "chat_template", None) is not None  # an instruction
    prompt_ids = encode_prompt(tokenizer, prompt, chat=chat)
    eos = eos_token_ids(tokenizer, decoder.target_model)
    common = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "eos_token_id": eos}
    _label("prompt")
    print(prompt, end="" if prompt.endswith("\n") else "\n", flush=True)
    # A warm-up pass: the first pass of a shape is slow, and on llama.cpp the prompt cache then holds the prompt,
    # so both timed runs start from it (else the second would skip the prefill the first paid for).
    log("warm-up pass")
    decoder.generate([prompt_ids], max_new_tokens=4, draft=None)
    _label("plain loop (target alone, greedy)")
    alone, _ = generate_streamed(decoder, tokenizer, prompt_ids, sys.stdout, draft=None, **common)
    print()
    _label(f"speculative (greedy, draft length {decoder.num_draft_tokens})")
    spec, _ = generate_streamed(decoder, tokenizer, prompt_ids, sys.stdout, **common)
    print()
    same = alone.tokens == spec.tokens
    summary = {
        "mode": decoder.mode,
        "identical_output": same,
        "tokens": len(spec.tokens[0]),
        "plain_loop_tokens_per_s": round(alone.stats.tokens_per_second, 3),
        "speculative_tokens_per_s": round(spec.stats.tokens_per_second, 3),
        "drafted_tokens": spec.stats.draft_tokens,
        "acceptance_rate": round(spec.stats.acceptance_rate, 3),
        "tokens_per_target_pass": round(spec.stats.tokens_per_target_pass, 3),
    }
    if spec.stats.draft_tokens:
        summary["speedup"] = round(alone.stats.total_time_s / spec.stats.total_time_s, 3)
    else:  # the same loop timed twice: a ratio would be noise, not a speed-up
        summary["speedup"] = None
        summary["not_drafted_because"] = _why_not_drafted(decoder)
    _label("summary")
    print(json.dumps(summary, indent=2))
    if not same:
        first = next(i for i, (a, b) in enumerate(zip(alone.tokens[0], spec.tokens[0] + [-1])) if a != b)
        if decoder.mode == "bitwise":
            raise CliError(f"outputs differ at token {first} in the bitwise mode: this is a bug, please report it "
                           "with the command line above")
        log(f"the outputs part at token {first}: in the exact-in-distribution mode a scoring pass of several tokens "
            "may round the last bits of a logit differently from a one-token pass, which flips a near-tie (the "
            "output's distribution is the target's; --bitwise for bitwise identity, docs/llamacpp.md)")
    return 0


def _why_not_drafted(decoder) -> str:
    """Why a demo's speculative run drafted nothing, in one line."""
    from ..models.pass_cost import priced_out_reason
    from ..policy import MOST_DRAFTS, paying_cap

    if decoder.drafter is None:
        if not paying_cap(decoder.pass_cost, 1, MOST_DRAFTS):
            return f"no draft was loaded: {priced_out_reason(decoder.target)}"
        return "no draft (--draft none)"
    steps = decoder.controller.snapshot()["steps_by_reason"]
    return ("the planner found no draft that pays here (steps by reason: "
            + ", ".join(f"{reason} {count}" for reason, count in sorted(steps.items())) + ")")


def _label(title: str) -> None:
    """A section heading on standard output, on a line of its own (the demo's texts are read from a file too)."""
    print(f"=== {title} ===", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API (completions, chat, streaming, metrics) with continuous batching."""
    try:
        from ..serving.config import ServerOptions, default_allowed_hosts, default_model_name, read_api_keys
        from ..serving.lifecycle import serve
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
    args.model_name = args.model_name or default_model_name(args.target)
    check_request_args(args)
    check_model_args(args, here=args.ray_address is None)  # a cluster's workers load from their own disks
    if args.replicas is not None or args.ray_address is not None:
        return _serve_on_ray(args, options)
    decoder, tokenizer = build_decoder(args)
    code = serve(decoder, tokenizer, model_name=args.model_name, host=args.host, port=args.port,
                 max_batch_size=args.max_batch_size, max_rows_per_request=args.max_rows_per_request,
                 max_context=args.max_context, default_max_tokens=args.max_new_tokens, options=options,
                 log_level=args.log_level, say=log)
    if code:  # a second signal: exit now, without the seconds the interpreter spends tearing the models down
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_batch(args: argparse.Namespace) -> int:
    """An offline job: every row of --input generated into --output (resumable), in-process or on Ray Data."""
    from ..offline import JobDefaults, run_batch

    _check_batch_files(args.input, args.output)
    check_request_args(args, BATCH_SAMPLING)
    check_model_args(args, here=args.ray_address is None)  # a cluster's workers load from their own disks
    defaults = JobDefaults(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, seed=args.seed)
    summary = run_batch(args.target, args.draft, input_path=args.input, output_path=args.output, workers=args.workers,
                        batch_size=args.batch_size, defaults=defaults, progress=not args.no_progress,
                        ray_address=args.ray_address, cpus_per_worker=args.cpus_per_worker,
                        gpus_per_worker=args.gpus_per_worker, **load_options(args))
    log(f"{summary.written} rows written to {args.output} ({summary.skipped} were already there, "
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
        from ..serving.ray import ReplicaSpec, Scaling, deploy
    except ImportError as error:
        raise CliError(f"--replicas and --ray-address need Ray Serve (pip install 'verispec[ray]'): {error}") from error
    spec = ReplicaSpec(
        target=args.target, draft=args.draft, model_name=args.model_name, load_options=load_options(args),
        max_batch_size=args.max_batch_size, max_rows_per_request=args.max_rows_per_request,
        max_context=args.max_context, default_max_tokens=args.max_new_tokens, options=options)
    scaling = Scaling(replicas=args.replicas or 1, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                      max_ongoing_requests=args.max_ongoing_requests)
    log(f"deploying {scaling.replicas} replica(s) of {spec.model_name} on Ray Serve "
         f"({args.ray_address or 'a local Ray instance'}); http://{args.host}:{args.port}/v1")
    deploy(spec, scaling, host=args.host, port=args.port, ray_address=args.ray_address)
    return 0
