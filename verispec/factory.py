"""Build a decoder from model names: the one factory the library, the CLI, the server and offline jobs share.

``load(target, draft)`` accepts zoo names, Hugging Face model folders, ``.gguf`` files and Hub ids
(``owner/name``), each resolved to local files once (``acquire.resolve``), and applies the CPU fast paths
(pre-packed target, int4 draft; a GGUF target and a GGUF draft with its tokenizer on llama.cpp) that the
benchmarks measure. It assembles models, drafters, policies and the decoder, so it sits above all of them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import torch

from .acquire import Progress, ZooError, check_source, gguf_size, is_gguf, resolve, say
from .decode import SpeculativeDecoder
from .decode.calibrate import CALIBRATION_LENGTHS, CALIBRATION_TEXT, calibrate as run_calibration
from .drafters import CompositeDrafter, CrossTokenizerDrafter, IntersectionDrafter, ModelDrafter, NGramDrafter
from .models.fast import int4_supported, prepack_linears, quantize_draft
from .models.loading import LoadError, load_model, load_tokenizer, parse_device, parse_model_dtype, same_tokenizer
from .models.backend import backend_of
from .models.pass_cost import priced_out_reason
from .policy import BEST_MODEL_ACCEPTANCE, MOST_DRAFTS, make_gamma_policy, paying_cap

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["BACKENDS", "LoadError", "check_load_options", "choose_backend", "load", "split_suffix_draft"]

BACKENDS = ("auto", "llama.cpp", "torch")  # what runs the target ("auto": llama.cpp for a GGUF on a CPU, if installed)

DRAFT_QUANTS = ("int4", "int8", "none")
CROSS_TOKENIZER_METHODS = ("text", "intersection")  # how a draft with another tokenizer drafts
# "suffix+MODEL": the speculation controller picks each row's source from measured costs and acceptance
# (policy/sources.py); rows whose tokens must not depend on timings (seeded sampling) use suffix decoding where
# its continuation scores at least this (expected tokens kept), else the model (arctic-inference's hybrid rule)
SUFFIX_OVER_MODEL_SCORE = 3.0


# Suffix decoding guesses this many tokens past a short match's evidence where a pass of 1 + that many tokens costs
# less than CHEAP_GUESSES times a one-token pass (benchmarks/suffix/tune.py); elsewhere it drafts its evidence only.
GUESSED_TOKENS, CHEAP_GUESSES = 4, 1.5
# Prompt lookup proposes a tree of its match's last LOOKUP_MATCHES occurrences where the target scores trees and a
# pass of 1 + LOOKUP_TREE_WIDTH tokens costs less than CHEAP_GUESSES one-token passes: the extra branches come
# almost free there; elsewhere each node costs a share of a pass, and the most recent match's chain is proposed.
LOOKUP_MATCHES, LOOKUP_TREE_WIDTH = 3, 7  # 1 + 7: a measured width of the pass-cost curve (widths between round up)


def lookup_matches(backend: Any) -> int:
    """How many earlier occurrences prompt lookup's tree merges on this target (1: a chain)."""
    if backend.tree_branches < 2:
        return 1
    cheap = backend.pass_cost(1 + LOOKUP_TREE_WIDTH, 1) < CHEAP_GUESSES * backend.pass_cost(1, 1)
    return min(LOOKUP_MATCHES, backend.tree_branches) if cheap else 1


# A draft model proposes its chain with each position's next most probable token beside it (MODEL_SIBLINGS nodes a
# depth, ``ModelDrafter(siblings=...)``) where the target scores trees and a pass of 1 + MODEL_SIBLINGS *
# MODEL_TREE_DEPTHS tokens costs less than CHEAP_GUESSES one-token passes; elsewhere a sibling costs a share of a pass.
MODEL_SIBLINGS, MODEL_TREE_DEPTHS = 2, 3  # 1 + 2 * 3 = 7, priced at the measured 8


def model_siblings(backend: Any) -> int:
    """Nodes a draft model proposes at each depth of its block on this target (1: a chain)."""
    if backend.tree_branches < 2:
        return 1
    width = 1 + MODEL_SIBLINGS * MODEL_TREE_DEPTHS
    return MODEL_SIBLINGS if backend.pass_cost(width, 1) < CHEAP_GUESSES * backend.pass_cost(1, 1) else 1


def suffix_beside_model():
    """The suffix settings of ``suffix+MODEL``'s suffix part."""
    from .drafters.suffix import SuffixSettings

    return SuffixSettings(min_score=SUFFIX_OVER_MODEL_SCORE, max_spec_offset=0.0)


def suffix_settings(pass_cost, trees: bool = False) -> Any:
    """Suffix decoding's settings alone beside a target whose passes cost ``pass_cost(width, rows)``: a few guessed
    tokens past a match where they cost little, the match's evidence only where each costs a share of a pass, and
    each draft cut to what its evidence pays for on this target (``SuffixSettings.pass_costs``); with ``trees``
    (a target that scores draft trees, ``TargetBackend.trees``), a tree where it pays more than the chain."""
    from .drafters.suffix import SuffixSettings

    one = pass_cost(1, 1)
    cheap = pass_cost(1 + GUESSED_TOKENS, 1) < CHEAP_GUESSES * one
    costs = tuple(pass_cost(1 + n, 1) / one for n in range(SuffixSettings.max_spec_tokens + 1))
    return SuffixSettings(max_spec_offset=float(GUESSED_TOKENS) if cheap else 0.0, pass_costs=costs, trees=trees)


# ``draft="auto"`` (the commands' default): a draft model where scoring a few tokens costs about one (torch), suffix
# decoding where each scored token costs a large share of a pass (llama.cpp on a CPU: the 0.5B GGUF draft there,
# ~0.68 of a target pass a token, measured below the target alone, as llama.cpp's own draft-simple is;
# benchmarks/llamacpp/README.md), so its drafts must be free to pay.
AUTO_DRAFT_MODEL = "qwen2.5-coder-0.5b"


def auto_draft(target: str, backend: str = "auto", device: str | torch.device = "cpu") -> str:
    """What ``draft="auto"`` means for ``target`` on ``backend``: ``"suffix"`` on llama.cpp, else
    ``AUTO_DRAFT_MODEL``."""
    return "suffix" if choose_backend(target, backend, device) == "llama.cpp" else AUTO_DRAFT_MODEL


def split_suffix_draft(draft: str | None) -> tuple[bool, str | None]:
    """``(suffix decoding?, the draft model's name or None)`` for a draft name: ``"suffix"``, ``"suffix+MODEL"``
    or anything else (a model, ``"ngram"``, ``"none"``, None)."""
    if draft == "suffix":
        return True, None
    if draft is not None and draft.startswith("suffix+"):
        model = draft[len("suffix+"):]
        if model in ("", "none", "ngram", "suffix"):
            raise ValueError(f"draft {draft!r}: after 'suffix+' name a draft model")
        return True, model
    return False, draft


def _check_decoder_options(options: dict[str, Any]) -> None:
    """Refuse bad ``SpeculativeDecoder`` options before minutes of loading, not after."""
    reserved = {"target_model", "draft_model", "drafter"} & options.keys()
    if reserved:
        raise TypeError(f"load() chooses {', '.join(sorted(reserved))} itself: name the draft with `draft=`")
    try:
        inspect.signature(SpeculativeDecoder).bind_partial(None, **options)
    except TypeError as error:
        raise TypeError(f"unknown SpeculativeDecoder option: {error}") from None
    if "num_draft_tokens" in options:
        make_gamma_policy(options["num_draft_tokens"])  # raises ValueError for a bad value


def _fast_draft(draft_model: PreTrainedModel, draft_quant: str, progress: Progress | None) -> PreTrainedModel:
    """The draft as the decoder will run it: quantised on a CPU (int4 where ATen's kernel can run, else int8),
    else pre-packed where that is supported."""
    on_cpu = next(draft_model.parameters()).device.type == "cpu"
    if on_cpu and draft_quant != "none" and getattr(draft_model.config, "is_encoder_decoder", False):
        # torch's dynamic int8 scales activations per call, so a row's logits depend on the other rows (T5 drafts
        # fail the rollback probe), and int4 needs input sizes T5's small models do not have: full precision
        say(progress, "draft: an encoder-decoder draft keeps its dtype (its quantised forms let rows interact)")
        draft_quant = "none"
    if on_cpu and draft_quant != "none":
        bits = 4 if draft_quant == "int4" and int4_supported(draft_model) else 8
        say(progress, f"draft: int{bits} weights (drafts may be lossy; the target decides every token)")
        return quantize_draft(draft_model, bits=bits)
    if prepack_linears(draft_model):
        say(progress, "draft: linear layers pre-packed for this CPU (same dtype)")
    return draft_model


def check_load_options(target: str, draft: str | None = None, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype | str | None = None, draft_quant: str = "int4", cross_tokenizer: str = "text",
                       here: bool = True, suffix_cache_size: int | None = None, suffix_scope: str = "global",
                       backend: str = "auto", **decoder_options: Any) -> None:
    """Raise what :func:`load` would raise for these arguments before it loads a model, without loading one:
    the dtype, the device, the decoder options, and the target and draft names (an unknown name, a missing path,
    a folder that is no model; a Hub id is only checked for its shape). ``here=False``: the models will be
    loaded on other machines (Ray workers), so this machine's paths and devices are not checked."""
    for name, value, allowed in (("draft_quant", draft_quant, DRAFT_QUANTS),
                                 ("cross_tokenizer", cross_tokenizer, CROSS_TOKENIZER_METHODS),
                                 ("backend", backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    parse_model_dtype(dtype)
    parse_device(device, here=here)
    _check_decoder_options(decoder_options)
    if draft == "auto":  # what it means depends on the backend, known here only
        draft = auto_draft(target, backend, device) if here else None
    suffix, draft = split_suffix_draft(draft)
    if suffix:
        _check_suffix_options(suffix_cache_size, suffix_scope, here)
    if here:
        for name in (target, draft):
            if name not in (None, "none", "ngram"):
                try:
                    check_source(name)
                except ZooError as error:
                    raise LoadError(f"cannot load model {name!r}: {error}") from error
        choose_backend(target, backend, device)


def choose_backend(target: str, backend: str = "auto", device: str | torch.device = "cpu") -> str:
    """``"llama.cpp"`` or ``"torch"``: what runs ``target``. ``"auto"`` picks llama.cpp for a GGUF target (zoo name,
    ``.gguf`` file) on a CPU when llama-cpp-python is installed. ``LoadError`` when ``"llama.cpp"`` cannot run it
    (not a GGUF, not the CPU, llama-cpp-python missing)."""
    from .models.llamacpp import llama_cpp_unavailable

    on_cpu = torch.device(device).type == "cpu"
    if backend == "auto":
        return "llama.cpp" if on_cpu and is_gguf(target) and llama_cpp_unavailable() is None else "torch"
    if backend == "llama.cpp":
        if not is_gguf(target):
            raise LoadError(f"cannot load model {target!r} on backend 'llama.cpp': it runs GGUF models only (a zoo "
                            "name, a .gguf file or a folder holding one); use backend 'torch'")
        if not on_cpu:
            raise LoadError(f"backend 'llama.cpp' runs on the CPU here, not on {device!s}; use backend 'torch'")
        problem = llama_cpp_unavailable()
        if problem is not None:
            raise LoadError(problem)
    return backend


def _check_suffix_options(cache_size: int | None, scope: str, here: bool) -> None:
    from .drafters.suffix import check_scope, suffix_unavailable

    check_scope(scope)
    if cache_size is not None and (isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0):
        raise ValueError(f"suffix_cache_size must be an integer >= 0 (earlier responses kept), got {cache_size!r}")
    problem = suffix_unavailable() if here else None
    if problem is not None:
        raise LoadError(problem)


def load(target: str, draft: str | None = None, *, device: str | torch.device = "cpu",
         dtype: torch.dtype | str | None = None, fast: bool = True, draft_quant: str = "int4",
         cross_tokenizer: str = "text", suffix_cache_size: int | None = None, suffix_scope: str = "global",
         progress: Progress | None = None, calibrate: bool = True, backend: str = "auto",
         llama_settings: Any = None, bitwise: bool | None = None, trees: bool = False,
         **decoder_options: Any) -> tuple[SpeculativeDecoder, PreTrainedTokenizerBase]:
    """``(SpeculativeDecoder, tokenizer)`` for ``target`` and an optional ``draft``.

    ``target`` / ``draft``: a zoo name (``verispec.zoo.ZOO``), a Hugging Face model folder, a ``.gguf`` file or
    a Hugging Face Hub id (``owner/name``, loaded with ``from_pretrained``: the HF cache, and the network unless
    ``HF_HUB_OFFLINE=1``). ``draft`` may also be ``"ngram"`` (prompt lookup), ``None`` / ``"none"`` (target
    alone) or ``"auto"`` (the commands' default, :func:`auto_draft`: suffix decoding on llama.cpp, else the
    0.5B coder draft model). A folder may hold an encoder-decoder (``AutoModelForSeq2SeqLM``: its inputs are then
    sources; ``AutoModelForSpeechSeq2Seq``, Whisper: input features; ``docs/models.md``). ``"suffix"`` is suffix decoding
    (``drafters/suffix.py``: drafts from the request's own text and from earlier responses, the last
    ``suffix_cache_size`` of them kept, shared as ``suffix_scope`` says: ``"global"``, ``"key"`` or ``"request"``);
    ``"suffix+MODEL"`` drafts each row from it or from the draft model ``MODEL`` (or not at all), as the speculation
    controller finds pays (``policy/sources.py``).
    ``dtype``: ``float32`` (the default), ``bfloat16`` or ``float16``; GGUF weights are dequantised to
    it. ``fast`` (CPU): pre-pack the target's linear layers (same dtype, same products: its output is its
    own) and quantise a draft model to ``draft_quant`` (``"int4"``, falling back to int8 where ATen's int4
    kernel cannot run, ``"int8"`` or ``"none"``); a lossy draft costs acceptance, never exactness, since the
    target decides every token. ``progress(message)`` receives one line per loading step.
    ``calibrate`` (on by default): time a few short greedy steps at several draft lengths before returning
    (``decode/calibrate.py``, seconds on a CPU), so that the first call already knows whether drafting pays.
    ``trees`` (off by default; ``--trees``): drafts as trees where the target scores them and a wider pass costs
    little (``docs/trees.md``): suffix decoding's tree where it beats its chain per step, prompt lookup's last matches
    merged, a draft model's chain with sibling leaves. Measured on a 2-core CPU they did not beat chains
    (``benchmarks/suffix/README.md``, "Draft trees"), so chains are the default.
    ``decoder_options`` go to ``SpeculativeDecoder`` (``num_draft_tokens``, ``stop_drafting``, ``vocab_size``,
    default ``len(tokenizer)``).
    ``backend``: what runs the target: ``"torch"``, ``"llama.cpp"`` (a GGUF on llama.cpp's CPU kernels and memory,
    ``models/llamacpp.py``; ``llama_settings``, a ``LlamaSettings``, says how; drafts, sampling and the loop are
    verispec's, greedy output token-identical to llama.cpp's plain greedy decoding) or ``"auto"`` (the default:
    llama.cpp for a GGUF target on a CPU when llama-cpp-python is installed, else torch). A draft model runs on
    llama.cpp too when the target does and it is a GGUF with the target's tokenizer (``draft_quant`` does not
    apply: the file's own quantisation, llama.cpp's fast defaults, ``models.llamacpp.draft_settings``); any other
    draft model runs on torch.
    ``bitwise``: the exactness mode. Off (the default, *exact in distribution*, the papers' guarantee): scoring
    passes run on the backend's fastest kernels and the acceptance rule is exact on their logits; greedy output
    equals the plain loop's but where the kernels' last bits flip a near-tie. On: every scoring pass bitwise
    equal to one-token decoding (probed at load; where only one-token passes are, the target runs alone).
    ``decoder.mode`` names the mode in force. None: ``llama_settings.bitwise`` where given, else off.

    ``decoder.generate`` stops at EOS only when given ``eos_token_id``: pass
    ``verispec.eos_token_ids(tokenizer, decoder.target_model)`` to stop where ``model.generate`` would.

    A draft whose tokenizer differs from the target's drafts as ``cross_tokenizer`` says: ``"text"`` through a
    ``CrossTokenizerDrafter`` (its greedy text re-tokenised for the target, verified as one-hot drafts) or
    ``"intersection"`` through an ``IntersectionDrafter`` (its distribution restricted to the tokens both
    vocabularies share); both exact, greedy and sampled. ``benchmarks/BLOCK_CROSS.md`` compares them.

    Raises ``LoadError`` (a ``ValueError``) for a bad dtype or device and a model that cannot be found or
    loaded; ``ValueError`` for a bad ``draft_quant``, ``cross_tokenizer`` or
    ``num_draft_tokens``, ``TypeError`` for an unknown decoder option. Options, the device's availability and
    both names are checked before any model is loaded (:func:`check_load_options`).
    """
    check_load_options(target, draft, device=device, dtype=dtype, draft_quant=draft_quant,
                       cross_tokenizer=cross_tokenizer, suffix_cache_size=suffix_cache_size,
                       suffix_scope=suffix_scope, backend=backend, **decoder_options)
    if draft == "auto":
        draft = auto_draft(target, backend, device)
        say(progress, f"draft: auto: {draft} (" + ("suffix decoding's drafts are free: on llama.cpp's CPU kernels a "
                      "draft model costs more than it saves" if draft == "suffix" else "a draft model") + ")")
    suffix, draft = split_suffix_draft(draft)
    torch_dtype, torch_device = parse_model_dtype(dtype), parse_device(device)

    say(progress, f"target: {target}")
    on_llama = choose_backend(target, backend, torch_device) == "llama.cpp"
    if on_llama:
        from .models.llamacpp import LlamaSettings

        settings = llama_settings or LlamaSettings()
        bitwise = settings.bitwise if bitwise is None else bitwise
        # Spare branch ids only where trees are asked for: llama.cpp reserves a row of logits per sequence id.
        settings = dataclasses.replace(settings, bitwise=bitwise, trees=settings.trees and trees)
        target_model, tokenizer = _load_llama(target, settings, progress)
    else:
        target_model, tokenizer = load_model(target, torch_dtype, torch_device, progress)
        if fast and prepack_linears(target_model):
            say(progress, "target: linear layers pre-packed for this CPU (same dtype)")
    bitwise = bool(bitwise)
    backend = backend_of(target_model, bitwise)
    if bitwise and not on_llama:
        say(progress, f"mode bitwise: scoring passes cut to {backend.pass_cap} token"
                      f"{'s' if backend.pass_cap != 1 else ''} (probed: the largest this build scores bitwise as "
                      "one-token decoding)")
    # A draft that cannot pay here would only cost memory (its weights, its KV cells): the planner never runs it.
    if draft not in (None, "none", "ngram"):
        if not paying_cap(backend.pass_cost, 1, MOST_DRAFTS):
            say(progress, f"draft: {draft} not loaded: {priced_out_reason(backend)}")
            draft = None
        elif on_llama and is_gguf(draft) and (why := _gguf_draft_cannot_pay(draft, target_model, backend)):
            # Free drafts can pay here (the test above): suffix decoding drafts where the model would not.
            say(progress, f"draft: {draft} not loaded: {why}" + ("" if suffix else "; suffix decoding drafts instead"))
            draft, suffix = None, True
    drafter, draft_model = None, None
    if draft == "ngram":
        drafter = NGramDrafter(matches=lookup_matches(backend) if trees else 1)
        if drafter.matches > 1:
            say(progress, f"draft: prompt lookup, a tree of its match's last {drafter.matches} continuations (a "
                          f"{1 + LOOKUP_TREE_WIDTH}-token pass costs under {CHEAP_GUESSES} one-token passes here)")
    elif draft not in (None, "none"):
        loaded = _load_llama_draft(draft, target_model, tokenizer, progress) if on_llama and is_gguf(draft) else None
        if loaded is None:
            say(progress, f"draft: {draft}, on torch")
            loaded = load_model(draft, torch_dtype, torch_device, progress)
            if fast:
                loaded = _fast_draft(loaded[0], draft_quant, progress), loaded[1]
        draft_model, draft_tokenizer = loaded
        if not same_tokenizer(tokenizer, draft_tokenizer) and cross_tokenizer == "text":
            say(progress, "draft: another tokenizer: its text is re-tokenised for the target (one-hot drafts, exact)")
            drafter, draft_model = CrossTokenizerDrafter(draft_model, draft_tokenizer, tokenizer), None
        elif not same_tokenizer(tokenizer, draft_tokenizer):
            drafter = IntersectionDrafter(draft_model, draft_tokenizer, tokenizer)
            say(progress, f"draft: another tokenizer: it drafts the {len(drafter.shared[0])} tokens both vocabularies "
                          "share (exact)")
            draft_model = None
    if suffix:
        drafter = _suffix_drafter(suffix_cache_size, suffix_scope, drafter, draft_model, backend, progress, trees)
        draft_model = None
    elif draft_model is not None and trees and (siblings := model_siblings(backend)) > 1:
        drafter, draft_model = ModelDrafter(draft_model.eval(), siblings), None
        say(progress, f"draft: a tree of its chain and each position's next most probable token (a "
                      f"{1 + MODEL_SIBLINGS * MODEL_TREE_DEPTHS}-token pass costs under {CHEAP_GUESSES} one-token "
                      "passes here)")
    decoder_options.setdefault("vocab_size", len(tokenizer))
    decoder = SpeculativeDecoder(target_model, draft_model, drafter=drafter, bitwise=bitwise, **decoder_options)
    if calibrate and decoder.drafter is not None and paying_cap(decoder.pass_cost, 1, MOST_DRAFTS):
        say(progress, "calibrating: timing a few steps at draft lengths "
                      f"{', '.join(map(str, CALIBRATION_LENGTHS))} (so the first call is priced)")
        features = decoder.limits.source_features  # a speech target calibrates on silence
        report = run_calibration(decoder, tokenizer(CALIBRATION_TEXT)["input_ids"] if features is None
                                 else torch.zeros(features))
        if report.step_seconds:
            say(progress, f"calibrated in {report.seconds:.1f} s: tokens per step "
                          + ", ".join(f"{k} drafts {t:.2f}" for k, t in report.tokens_per_step.items()))
    _give_back_freed_memory()
    return decoder, tokenizer


def _give_back_freed_memory() -> None:
    """Loading frees much on the way (the tokenizer's JSON, conversion and staging buffers), and glibc keeps freed
    heap for reuse rather than return it: hand it back once, after the load (``malloc_trim``; ~50 MB for the 1.5B
    GGUF's server, ``benchmarks/llamacpp/README.md``). Nothing where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_llama(target: str, settings: Any, progress: Progress | None) -> tuple[Any, PreTrainedTokenizerBase]:
    from .models.llamacpp import load_llama

    try:
        files = resolve(target, backend="llama.cpp", progress=progress)
        tokenizer = load_tokenizer(files, progress)
        return load_llama(files.path, settings, progress), tokenizer
    except (ZooError, ValueError, OSError, ImportError, RuntimeError) as error:
        raise LoadError(f"cannot load model {target!r} on llama.cpp: {error}") from error


def _gguf_draft_cannot_pay(draft: str, target_model: Any, backend: Any) -> str | None:
    """Why a GGUF draft model cannot pay beside this llama.cpp target, or None. Priced before it is installed or
    loaded: a drafted token costs the draft file's share of a target pass (a CPU decodes at the speed it reads
    weights), and no draft length, each draft kept at ``BEST_MODEL_ACCEPTANCE``, may commit tokens for less
    than the target alone."""
    size = gguf_size(draft)
    if not size:
        return None
    share, one = size / target_model.path.stat().st_size, backend.pass_cost(1, 1)
    if paying_cap(backend.pass_cost, 1, MOST_DRAFTS, share * one, BEST_MODEL_ACCEPTANCE):
        return None
    return (f"a drafted token would cost ~{share:.2f} of a target pass (the files' sizes) and a pass of 2 / 9 tokens "
            f"costs {backend.pass_cost(2, 1) / one:.2f} / {backend.pass_cost(9, 1) / one:.2f} one-token passes here: "
            f"even with each draft kept at {BEST_MODEL_ACCEPTANCE} (the best acceptance measured) no draft length "
            "beats the target alone")


def _load_llama_draft(draft: str, target_model: Any, tokenizer: PreTrainedTokenizerBase,
                      progress: Progress | None) -> tuple[Any, PreTrainedTokenizerBase] | None:
    """A GGUF draft on llama.cpp beside a llama.cpp target (``LlamaModel`` with ``draft_settings``), or None when
    its tokenizer is not the target's: cross-tokenizer drafting edits a torch cache, so that draft runs on torch."""
    from .models.llamacpp import load_llama_draft

    try:
        files = resolve(draft, backend="llama.cpp", progress=progress)
        draft_tokenizer = load_tokenizer(files, progress)
        if not same_tokenizer(tokenizer, draft_tokenizer):
            say(progress, f"draft: {draft} has another tokenizer than the target (cross-tokenizer drafting needs a "
                          "torch model)")
            return None
        say(progress, f"draft: {draft}, on llama.cpp beside the target")
        return load_llama_draft(files.path, target_model.settings, progress), draft_tokenizer
    except (ZooError, ValueError, OSError, ImportError, RuntimeError) as error:
        raise LoadError(f"cannot load draft {draft!r} on llama.cpp: {error}") from error


def _suffix_drafter(cache_size: int | None, scope: str, model_drafter: Any, draft_model: PreTrainedModel | None,
                    backend: Any, progress: Progress | None, trees: bool = False) -> Any:
    """Suffix decoding, alone or (given a draft) before it: ``CompositeDrafter(suffix, draft)``."""
    from .drafters.suffix import DEFAULT_CACHE_SIZE, SuffixDrafter

    cache_size = DEFAULT_CACHE_SIZE if cache_size is None else cache_size
    fallback = ModelDrafter(draft_model.eval()) if draft_model is not None else model_drafter
    # Beside a model, suffix drafts only as long as their match (vLLM's offset 0): the offset's guesses after a
    # short match would score like a long copy and take rows from a model that is usually right.
    settings = (suffix_settings(backend.pass_cost, trees and backend.tree_branches > 1) if fallback is None
                else suffix_beside_model())
    suffix = SuffixDrafter(cache_size, scope, settings)
    say(progress, f"draft: suffix decoding ({cache_size} earlier responses kept, scope {scope!r})"
                  + ("; the model where it pays more, row by row" if fallback is not None else ""))
    return suffix if fallback is None else CompositeDrafter(suffix, fallback)
