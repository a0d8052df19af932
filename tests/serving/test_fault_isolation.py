"""One request's failure inside an engine step ends that request alone: the others in its batch finish with the
tokens they would produce alone, and the failing one says "internal error" (its traceback only in the log). On
torch and on llama.cpp, whose context holds a fixed number of rows: the failed batch gives its rows back before
any row steps alone, so none is left without one."""

from __future__ import annotations

import logging
import threading

import pytest
import tiny_llama
from tiny_llama import VOCAB as LLAMA_VOCAB
from tiny_llama import kept_cells_match_their_tokens, write_gguf
from tiny_models import pair, perturbed, prompt, reference_greedy

from verispec import SpeculativeDecoder
from verispec.serving.engine import INTERNAL_ERROR, Engine, EngineRequest, FinishEvent, TokensEvent

tiny_gguf = tiny_llama.tiny_gguf  # the session fixture that writes the tiny GGUF

HEALTHY = [(prompt(5, 1), 12), (prompt(7, 2), 15), (prompt(3, 3), 9)]
SAMPLED = EngineRequest(prompt(6, 4), max_new_tokens=14, temperature=0.8, top_p=0.9, seed=11)

# Every setting a row carries, each forced past validation to a value that raises inside a step (validation
# refuses all of them before admission; these stand for whatever bug a setting may still meet in the kernels).
# The poisoned row samples (its warpers run) and has a stop id (its min_tokens mask runs).
POISONS = {
    "min_tokens": ("sampling", 2**64),  # the overflow found by probing the server: int64 tensors
    "presence_penalty": ("sampling", "x"),
    "frequency_penalty": ("sampling", "x"),
    "repetition_penalty": ("sampling", "x"),
    "logit_bias": ("sampling", ((3, "x"),)),
    "stop_token_ids": ("sampling", ("x",)),
    "temperature": ("sampling", "x"),
    "top_k": ("sampling", -3),
    "top_p": ("sampling", "x"),
    "min_p": ("sampling", "x"),
    "grammar": ("sampling", object()),
    "seed": ("row", "generator", object()),
    "logprobs": ("row", "logprobs", "x"),
    "max_new_tokens": ("row", "max_new_tokens", "x"),
}


class Collector:
    def __init__(self, poison=None, after: int = 0) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()
        self.poison, self.after, self.row = poison, after, None

    def __call__(self, event) -> None:  # the engine thread, between steps
        if isinstance(event, TokensEvent):
            self.tokens.extend(event.tokens)
            if self.poison is not None and len(self.tokens) >= self.after:
                self.poison(self.row)
                self.poison = None
        else:
            self.finish = event
            self.done.set()


def _poison(field: str):
    spec = POISONS[field]

    def apply(row) -> None:
        if spec[0] == "sampling":
            object.__setattr__(row.sampling, field, spec[1])  # past SamplingParams' own checks
        else:
            setattr(row, spec[1], spec[2])

    return apply


@pytest.fixture(scope="module")
def decoder() -> SpeculativeDecoder:
    target, draft, _ = pair("qwen2")
    return SpeculativeDecoder(target, draft, num_draft_tokens=3)


def _run(decoder, requests: list[tuple[EngineRequest, Collector]]) -> None:
    """All requests in one batch: queued before the engine starts."""
    engine = Engine(decoder, max_batch_size=8)
    try:
        for request, collector in requests:
            handle = engine.submit(request, collector)
            collector.row = engine._open[handle._key].row
            if collector.poison is not None and collector.after == 0:
                collector.poison(collector.row)
                collector.poison = None
        engine.start()
        for _, collector in requests:
            assert collector.done.wait(120)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sampled_alone(decoder) -> list[int]:
    alone = Collector()
    _run(decoder, [(SAMPLED, alone)])
    assert alone.finish.reason == "length"
    return alone.tokens


@pytest.mark.parametrize("after", [0, 4], ids=["first-step", "mid-generation"])
@pytest.mark.parametrize("field", list(POISONS))
def test_a_poisoned_row_fails_alone(decoder, sampled_alone, field, after, caplog) -> None:
    target = pair("qwen2")[0]
    healthy = [(EngineRequest(p, max_new_tokens=n), Collector()) for p, n in HEALTHY]
    sampled = (SAMPLED, Collector())
    poisoned = (EngineRequest(prompt(4, 9), max_new_tokens=12, temperature=0.7, seed=5, eos_token_ids=[0],
                              sampling_options={"min_tokens": 2}, logprobs=2), Collector(_poison(field), after))
    with caplog.at_level(logging.ERROR, logger="verispec.serving.engine"):
        _run(decoder, [healthy[0], poisoned, healthy[1], sampled, healthy[2]])
    for (request, collector), (p, n) in zip(healthy, HEALTHY):
        assert collector.finish.reason == "length", collector.finish.error
        assert collector.tokens == reference_greedy(target, p, n)
    assert sampled[1].finish.reason == "length" and sampled[1].tokens == sampled_alone
    failed = poisoned[1]
    assert failed.finish.reason == "error" and failed.finish.error == INTERNAL_ERROR
    assert len(failed.tokens) >= after
    # The traceback is in the log, with the row's key, never in the event.
    assert any(record.exc_info and f"engine row {failed.row.key} " in record.getMessage()
               for record in caplog.records)


# ----------------------------------------------------------------------------------------- on llama.cpp

LLAMA_ROWS = 6  # the context's sequences: the four healthy rows and the poisoned one fit once, not twice
LLAMA_HEALTHY = [(prompt(9, 21, LLAMA_VOCAB - 1), 14), (prompt(5, 22, LLAMA_VOCAB - 1), 17),
                 (prompt(13, 23, LLAMA_VOCAB - 1), 11), (prompt(7, 24, LLAMA_VOCAB - 1), 15)]


def _poison_prompt(row) -> None:
    """A token id past the vocabulary in the middle of the prompt: llama.cpp refuses the prefill's batch."""
    row.prompt = row.prompt[:3] + [LLAMA_VOCAB + 5] + row.prompt[3:]


@pytest.fixture(scope="module")
def llama_models(tiny_gguf, tmp_path_factory):
    """The tiny GGUF as the target and a partly agreeing GGUF draft beside it, both on llama.cpp and holding
    ``LLAMA_ROWS`` sequences each."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/llamacpp.md)")
    from verispec.models.llamacpp import LlamaModel, LlamaSettings, load_llama_draft

    draft_path = tmp_path_factory.mktemp("fault-draft") / "draft.gguf"
    write_gguf(perturbed(tiny_gguf[1], scale=0.15), draft_path)
    with LlamaModel(tiny_gguf[0], LlamaSettings(n_ctx=256, n_threads=1, n_seq_max=LLAMA_ROWS)) as target:
        with load_llama_draft(draft_path, target.settings) as draft:
            yield target, draft


@pytest.mark.parametrize(("poison", "after"), [(_poison_prompt, 0), (_poison("temperature"), 4),
                                               (_poison("logprobs"), 0)],
                         ids=["prompt-first-step", "temperature-mid-generation", "logprobs-first-step"])
def test_a_poisoned_row_fails_alone_on_llama_cpp(llama_models, poison, after, caplog) -> None:
    """A poisoned row among four healthy ones on the llama.cpp backend, a draft model on llama.cpp beside it: the
    healthy rows finish with llama.cpp's plain greedy output, the poisoned one with "internal error", and every
    sequence of the target and of the draft is free again afterwards (the log still holds the tracebacks)."""
    from verispec.models.llamacpp import greedy_reference

    target, draft = llama_models
    decoder = SpeculativeDecoder(target, draft, num_draft_tokens=3)
    healthy = [(EngineRequest(p, max_new_tokens=n), Collector()) for p, n in LLAMA_HEALTHY]
    poisoned = (EngineRequest(prompt(6, 25, LLAMA_VOCAB - 1), max_new_tokens=12, temperature=0.7, seed=5),
                Collector(poison, after))
    with caplog.at_level(logging.ERROR, logger="verispec.serving.engine"):
        _run(decoder, [healthy[0], healthy[1], poisoned, healthy[2], healthy[3]])
    for (request, collector), (p, n) in zip(healthy, LLAMA_HEALTHY):
        assert collector.finish.reason == "length", collector.finish.error
        assert collector.tokens == greedy_reference(target, p, n)
    failed = poisoned[1]
    assert failed.finish.reason == "error" and failed.finish.error == INTERNAL_ERROR
    assert len(failed.tokens) >= after
    assert any(record.exc_info and f"engine row {failed.row.key} " in record.getMessage()
               for record in caplog.records)
    for model in (target, draft):  # no sequence left behind, though the tracebacks above still hold their frames
        assert len(model._free_seqs) == LLAMA_ROWS
        kept_cells_match_their_tokens(model)  # what the prompt cache keeps of finished rows: their tokens' cells
        assert model.context.used_cells() == sum(len(held) for _, held in model._kept.values())
