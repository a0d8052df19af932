"""What the commands share: the one error type users see, reading the prompt, checking arguments before any
model loads, building the decoder through the library's factory, and writing text as tokens arrive.

Plain Python at import: torch and transformers are imported inside the functions that need them, so that
``verispec --help`` answers at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..text import ChatTemplateError, TextState, chat_prompt_ids


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def log(message: str) -> None:
    print(f"[verispec] {message}", file=sys.stderr, flush=True)


def build_decoder(args: argparse.Namespace, progress: Callable[[str], None] = log):
    """Load the target (and draft) named by ``args`` with the library factory; returns ``(decoder, tokenizer)``."""
    from ..factory import load
    from ..models import LoadError

    try:
        return load(args.target, args.draft, progress=progress, calibrate=getattr(args, "calibrate", True),
                    **load_options(args))
    except LoadError as error:
        raise CliError(str(error)) from error


def load_options(args: argparse.Namespace) -> dict:
    """``verispec.load``'s options from the command line but the names, ``progress`` and ``calibrate`` (what
    ``batch`` and ``serve --replicas`` pass on too); a flag the namespace lacks (a benchmark's) keeps its default,
    and so does ``num_draft_tokens`` where the command leaves it to the job (``batch``: None)."""
    schedule = gamma_arg(args.num_draft_tokens)
    return {"device": args.device, "dtype": args.dtype, "fast": args.fast,
            **({} if schedule is None else {"num_draft_tokens": schedule}), "llama_settings": llama_settings(args),
            "draft_quant": getattr(args, "draft_quant", "int4"),
            "cross_tokenizer": getattr(args, "cross_tokenizer", "text"),
            "stop_drafting": getattr(args, "stop_drafting", True), "backend": getattr(args, "backend", "auto"),
            "bitwise": getattr(args, "bitwise", False), "trees": getattr(args, "trees", False), **suffix_options(args)}


def llama_settings(args: argparse.Namespace):
    """``LlamaSettings`` from ``--bitwise``, ``--llama-threads``, ``--llama-ctx``, ``--llama-streams`` /
    ``--no-llama-streams``, ``--no-llama-prompt-cache`` and the most rows the command decodes at once (a KV stream
    per row, and llama.cpp's logits buffer, are sized by it): ``llama_rows`` (one, for ``generate`` and ``demo``),
    else ``--max-batch-size`` (``serve``), else ``--batch-size`` (``batch``); None when the command says none of
    these (the backend's defaults)."""
    rows = next((value for value in (getattr(args, name, None) for name in ("llama_rows", "max_batch_size",
                                                                              "batch_size")) if value), None)
    chosen = {"n_threads": getattr(args, "llama_threads", None), "n_ctx": getattr(args, "llama_ctx", None),
              "n_seq_max": rows, "streams": getattr(args, "llama_streams", None),
              "prompt_cache": getattr(args, "llama_prompt_cache", None),
              "bitwise": getattr(args, "bitwise", None) or None}
    chosen = {name: value for name, value in chosen.items() if value is not None}
    if not chosen:
        return None
    if chosen.get("n_threads", 1) < 1:
        raise CliError(f"--llama-threads must be at least 1, got {chosen['n_threads']}")
    if chosen.get("n_ctx", 64) < 64:
        raise CliError(f"--llama-ctx must be at least 64 tokens, got {chosen['n_ctx']}")
    from ..models.llamacpp import LlamaSettings

    return LlamaSettings(**chosen)


def suffix_options(args: argparse.Namespace) -> dict:
    """``load``'s suffix decoding options from the command line (its cache size; serve's scope)."""
    return {"suffix_cache_size": getattr(args, "suffix_cache_size", None),
            "suffix_scope": getattr(args, "suffix_scope", None) or "global"}


# The sampling flags of each command, by their ``SamplingParams`` names (``generate`` takes the same keywords).
GENERATE_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens")
BATCH_SAMPLING = ("temperature", "top_k", "top_p")  # the defaults of rows that give none (``JobDefaults``)


def check_request_args(args: argparse.Namespace, sampling_names: tuple[str, ...] = ()) -> None:
    """Refuse sampling settings and a token budget that generation would refuse, before any model loads: the
    library's own rules (``SamplingParams``, ``validate_request``), with the model-free half of the limits (one
    token id, no length limit); the decoder checks again against its models. Raises ``ValueError``."""
    from ..core.sampling import SamplingParams
    from ..decode.requests import ModelLimits, validate_request

    sampling = SamplingParams(**{name: getattr(args, name) for name in sampling_names})
    if args.max_new_tokens is not None:
        validate_request(ModelLimits(vocab_size=1, input_limit=1, max_positions=None), [[0]], sampling,
                         args.max_new_tokens, seed=getattr(args, "seed", None))


def check_model_args(args: argparse.Namespace, here: bool = True) -> None:
    """Refuse what ``verispec.load`` would refuse, before any model loads: dtype, device (and, with ``here``,
    whether this machine has it), the draft options, and the target and draft names (``here``: on this
    machine's disk or in the zoo; ``here=False`` when Ray workers load the models elsewhere)."""
    from ..factory import check_load_options
    from ..models import LoadError

    options = load_options(args)
    for unchecked in ("fast", "llama_settings", "bitwise", "trees"):  # what load takes but check_load_options does not
        del options[unchecked]
    try:
        check_load_options(args.target, args.draft, here=here, **options)
    except LoadError as error:
        raise CliError(str(error)) from error


def gamma_arg(value: str | None) -> int | str | None:
    if value in (None, "auto", "heuristic"):  # None: the command's own default (``batch``: ``batch_schedule``)
        return value
    try:
        return int(value)
    except ValueError:
        raise CliError(f"--num-draft-tokens must be an integer, 'auto' or 'heuristic', got {value!r}") from None


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


def generate_streamed(decoder, tokenizer, prompt_ids: list[int], out, **options):
    """``decoder.generate`` on one prompt, its text written to ``out`` (if given) as the tokens come; returns
    the output and the whole text. An encoder-decoder's text follows its decoder's start tokens, not its input."""
    start = decoder.limits.decoder_prompt
    state = TextState(tokenizer, prompt_ids if start is None else start)

    def write(text: str) -> None:
        if out is not None and text:
            out.write(text)
            out.flush()

    result = decoder.generate([prompt_ids], on_tokens=lambda row, tokens: write(state.add(tokens)), **options)
    write(state.flush())
    return result, state.text


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
