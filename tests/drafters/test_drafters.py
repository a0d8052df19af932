"""Drafting strategies: prompt lookup, early exit (self-speculation), prompt lookup with a model fallback, and
an int8 draft. Every one must leave the output exact (greedy: token for token the target's own `generate`;
sampling: the target's law, by chi-square at significance 1e-6, in tests/stats/test_drafter_law.py), and must
actually draft: a drafter that never proposes, or whose drafts are never accepted, would pass any equality test."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import KINDS, AlwaysDraft, ConfidentDrafter, build, pair, prompt, reference_greedy

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams
from verispec.drafters import (
    CompositeDrafter,
    Drafter,
    EarlyExitDrafter,
    ModelDrafter,
    NGramDrafter,
    Proposal,
)
from verispec.drafters.early_exit import find_decoder_layers, truncated_layers
from verispec.models.fast import quantize_draft

# --- NGramDrafter.lookup ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "history, k, max_ngram, min_ngram, expected",
    [
        ([1, 2, 3, 4], 3, 3, 1, []),  # no token of the suffix occurred before
        ([], 3, 3, 1, []),
        ([7], 3, 3, 1, []),  # a single token has nothing earlier to match
        ([3, 1, 4, 1], 3, 3, 2, []),  # [1] recurs, but min_ngram=2 refuses a 1-gram match
        ([1, 1, 1, 1], 3, 3, 1, [1]),  # overlapping occurrence of [1, 1, 1]; only one token follows it
        ([7, 1, 2, 1, 2, 1], 4, 3, 1, [2, 1]),  # [1, 2, 1] at 1..3 overlaps the suffix at 3..5
        ([9, 4, 4], 3, 1, 1, [4]),  # the occurrence ends right before the suffix: its continuation is the suffix
        ([5, 6, 7, 5, 6], 5, 3, 1, [7, 5, 6]),  # continuation runs to the very end of the history
        ([1, 2, 3, 7, 4, 3, 8, 1, 2, 3], 3, 3, 1, [7, 4, 3]),  # the 3-gram [1,2,3] beats the later 1-gram [3]
        ([1, 2, 3, 7, 4, 3, 8, 1, 2, 3], 3, 1, 1, [8, 1, 2]),  # only 1-grams: the most recent [3] (index 5)
        ([1, 5, 1, 6, 1], 2, 3, 1, [6, 1]),  # [1] occurs at 0 and 2: the most recent wins
        ([1, 5, 9, 1, 6, 9, 2, 1, 5, 9], 4, 3, 1, [1, 6, 9, 2]),  # longest first, then most recent
        ([4, 8, 4, 8, 4, 8], 1, 2, 1, [4]),  # k=1 cuts the continuation
    ],
)
def test_ngram_lookup(history, k, max_ngram, min_ngram, expected) -> None:
    assert NGramDrafter(max_ngram, min_ngram).lookup(history, k) == expected


def test_ngram_lookup_never_reads_past_the_history_or_mutates_it() -> None:
    history = [2, 3, 2, 3, 2]
    drafter = NGramDrafter(max_ngram=4)
    for k in range(1, 8):
        found = drafter.lookup(history, k)
        # The 3-gram [2, 3, 2] last occurred at 0..2 (the 4-gram never did): [3, 2] follows it, then the end.
        assert found == [3, 2][:k]
    assert history == [2, 3, 2, 3, 2]


def test_ngram_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(max_ngram=3, min_ngram=0)


def test_ngram_proposal_has_per_row_lengths() -> None:
    drafter = NGramDrafter()
    drafter.start([[1, 2, 1], [5, 6, 7], [4, 4]], SamplingParams(), 512)
    proposal = drafter.propose(3, None)
    assert proposal.draft_probs is None  # deterministic: verified as one-hot
    assert proposal.draft_lengths.tolist() == [2, 0, 1]
    assert proposal.draft_ids[0].tolist() == [2, 1, 0][: proposal.draft_ids.shape[1]]
    assert proposal.draft_ids[2, 0].item() == 4
    drafter.update([1, 0, 0], [[2, 9], [3], [8]])
    assert drafter.histories == [[1, 2, 1, 2, 9], [5, 6, 7, 3], [4, 4, 8]]
    drafter.select_rows([2, 0])
    assert drafter.histories == [[4, 4, 8], [1, 2, 1, 2, 9]]


# --- Early exit ------------------------------------------------------------------------------------------------


def _layers(model):
    parent, attribute = find_decoder_layers(model)
    return getattr(parent, attribute)


@pytest.mark.parametrize(
    "kind, path", [("gpt2", "transformer.h"), ("llama", "model.layers"), ("qwen2", "model.layers")]
)
def test_decoder_layers_are_found_without_knowing_the_class(kind: str, path: str) -> None:
    model = build(kind, layers=3)
    parent, attribute = find_decoder_layers(model)
    assert parent.get_submodule(attribute) is model.get_submodule(path)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_layers_restores_the_model_after_use_and_on_error(kind: str) -> None:
    model = build(kind, layers=3)
    layers, config = _layers(model), model.config
    ran = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    try:
        with truncated_layers(model, 1):
            assert len(_layers(model)) == 1 and _layers(model)[0] is layers[0]  # same module: no weight copy
            assert config.num_hidden_layers == 1
            model(torch.tensor([[1, 2, 3]]))
        assert ran == [0]
        assert _layers(model) is layers and config.num_hidden_layers == 3

        with pytest.raises(RuntimeError, match="inside"):
            with truncated_layers(model, 2):
                raise RuntimeError("inside the block")
        assert _layers(model) is layers and config.num_hidden_layers == 3

        ran.clear()
        with pytest.raises(IndexError):  # an error raised by the model's own forward
            with truncated_layers(model, 2):
                model(torch.tensor([[1, 10_000]]))
        assert _layers(model) is layers and config.num_hidden_layers == 3
        model(torch.tensor([[1, 2, 3]]))
        assert ran[-3:] == [0, 1, 2]  # whole again
    finally:
        for handle in handles:
            handle.remove()
    with pytest.raises(ValueError, match="num_layers"):
        with truncated_layers(model, 4):
            pass
    assert _layers(model) is layers and config.num_hidden_layers == 3


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_model_is_its_first_layers_then_its_own_norm_and_head(kind: str) -> None:
    big = build(kind, seed=5, layers=3)
    small = build(kind, seed=6, layers=2)
    small_keys = set(small.state_dict())
    small.load_state_dict({k: v for k, v in big.state_dict().items() if k in small_keys})
    ids = torch.tensor([prompt(7, 1)])
    with torch.no_grad():
        with truncated_layers(big, 2):
            early = big(ids).logits
        torch.testing.assert_close(early, small(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(early, big(ids).logits, atol=1e-3)


def test_early_exit_rejects_bad_layer_counts() -> None:
    target = pair("llama")[0]
    for bad in (0, 3, -1, True, 1.0):
        with pytest.raises(ValueError, match="num_layers"):
            EarlyExitDrafter(target, bad)


@pytest.mark.parametrize("kind", KINDS)
def test_early_exit_with_every_layer_is_the_target(kind: str) -> None:
    target = pair(kind)[0]
    sizes = sum(p.numel() for p in target.parameters())
    lengths = [5, 2, 8]
    prompts = [repetitive_prompt(n, seed=40 + b) for b, n in enumerate(lengths)]
    for num_layers in (1, 2):
        drafter = EarlyExitDrafter(target, num_layers)
        out = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4).generate(prompts, max_new_tokens=MAX_NEW)
        assert out.tokens == [list(expected(kind, 40 + b, n)) for b, n in enumerate(lengths)]
        assert out.stats.draft_tokens > 0
        if num_layers == 2:  # all the layers: the drafts are the target's own greedy tokens
            assert out.stats.acceptance_rate == 1.0
        else:
            assert 0.0 < out.stats.acceptance_rate < 1.0, out.stats.acceptance_rate
        assert len(drafter.lm.cache.layers) == num_layers  # the draft's cache holds only its layers
        assert len(_layers(target)) == 2 and target.config.num_hidden_layers == 2
        assert drafter.model is target and sum(p.numel() for p in target.parameters()) == sizes


# --- Exactness suite: every drafter, three model classes, batch 1 and 3 -----------------------------------------

MAX_NEW = 17  # not a multiple of the draft length
GAMMA = 3


def repetitive_prompt(length: int, seed: int) -> list[int]:
    """A random block repeated, so prompt lookup has something to find from the first step on."""
    base = prompt(length, seed)
    return base + base + base[: length // 2]


@functools.lru_cache(maxsize=None)
def expected(kind: str, seed: int, length: int) -> tuple[int, ...]:
    return tuple(reference_greedy(pair(kind)[0], repetitive_prompt(length, seed), MAX_NEW))


@functools.lru_cache(maxsize=None)
def int8_draft(kind: str):
    return quantize_draft(pair(kind)[0])


def make_drafter(name: str, kind: str):
    """A Drafter, or a draft model the decoder wraps in a ModelDrafter."""
    target, partial, _ = pair(kind)
    if name == "model":
        return ModelDrafter(partial)
    if name == "ngram":
        return NGramDrafter()
    if name == "early_exit":
        return EarlyExitDrafter(target, 1)
    if name == "composite":
        return CompositeDrafter(NGramDrafter(), ModelDrafter(partial))
    if name == "composite_early_exit":
        return CompositeDrafter(NGramDrafter(), EarlyExitDrafter(target, 1))
    if name == "int8":
        return int8_draft(kind)
    if name == "model_early_stop":  # random tiny models are unsure (top probability ~0.01): thresholds to match
        return ConfidentDrafter(partial, [1.0, 1e-4, 0.0])
    raise ValueError(name)


# (block length, seed) per row: mixed prompt lengths 7, 12 and 20. The target's greedy text on these prompts falls
# into repeats that prompt lookup finds (asserted below: a lookup nothing ever accepts would test nothing).
EXACTNESS_ROWS = [(3, 63), (5, 40), (8, 42)]
DRAFTERS = ("model", "ngram", "early_exit", "composite", "composite_early_exit", "int8", "model_early_stop")


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_drafter_is_exact_under_greedy(kind: str, name: str, batch_size: int) -> None:
    target = pair(kind)[0]
    rows = EXACTNESS_ROWS[:batch_size]
    prompts = [repetitive_prompt(n, seed) for n, seed in rows]
    draft = make_drafter(name, kind)
    decoder = (
        SpeculativeDecoder(target, drafter=draft, num_draft_tokens=GAMMA)
        if isinstance(draft, Drafter)
        else SpeculativeDecoder(target, draft, num_draft_tokens=GAMMA)
    )
    out = decoder.generate(prompts, max_new_tokens=MAX_NEW)
    assert out.tokens == [list(expected(kind, seed, n)) for n, seed in rows]
    assert out.finish_reasons == ["length"] * batch_size
    assert out.stats.draft_tokens > 0 and out.stats.acceptance_rate > 0.0, out.stats.to_dict()
    if name.startswith("composite"):
        assert draft.lookup_rows > 0  # prompt lookup was used...
        assert draft.fallback.calls > 0  # ...and so was the model
    if name == "int8":
        assert out.stats.acceptance_rate > 0.5
    if name == "model_early_stop":
        assert draft.short_blocks > 0  # blocks were cut short (row 0 always, after its first draft)


def test_early_stop_cuts_each_row_at_its_own_threshold() -> None:
    target, partial, _ = pair("llama")
    drafter = ConfidentDrafter(partial, [1.0, 1e-30, 0.0])
    prompts = [prompt(5, 1), prompt(7, 2), prompt(6, 3)]
    drafter.start(prompts, SamplingParams(), 512)
    proposal = drafter.propose(4, None)
    # Row 0 stops after its first draft (no probability reaches 1); rows 1 and 2 draft all 4. Rows 1 and 2 keep
    # the drafting going, so the proposal has all 4 columns, and row 0's extra columns are filler.
    assert proposal.draft_lengths.tolist() == [1, 4, 4] and proposal.draft_ids.shape == (3, 4)
    # The drafts themselves are the plain greedy drafts: stopping never changes what was proposed.
    plain = ModelDrafter(partial)
    plain.start(prompts, SamplingParams(), 512)
    assert torch.equal(plain.propose(4, None).draft_ids[1:], proposal.draft_ids[1:])
    # Every row stopped: no further draft passes.
    alone = ConfidentDrafter(partial, [1.0])
    alone.start(prompts, SamplingParams(), 512)
    calls = alone.calls
    out = alone.propose(4, None)
    assert out.draft_ids.shape == (3, 1) and out.draft_lengths.tolist() == [1, 1, 1]
    assert alone.calls - calls == 2  # the prompts' prefill (deferred to the first proposal), one draft pass


# --- The composite keeps its fallback in step -------------------------------------------------------------------


class Recording(Drafter):
    """Wraps a drafter; records, per proposal, each row's committed history and proposed tokens."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.steps: list[list[tuple[list[int], list[int]]]] = []

    @property
    def calls(self) -> int:  # type: ignore[override]
        return self.inner.calls

    def start(self, prompts, sampling, vocab_size) -> None:
        self.histories = [list(p) for p in prompts]
        self.inner.start(prompts, sampling, vocab_size)

    def propose(self, num_draft_tokens: int, uniforms, stop_below=None) -> Proposal:
        proposal = self.inner.propose(num_draft_tokens, uniforms, stop_below)
        width = proposal.draft_ids.shape[1]
        lengths = [width] * len(self.histories) if proposal.draft_lengths is None else proposal.draft_lengths.tolist()
        drafts = [proposal.draft_ids[b, : lengths[b]].tolist() for b in range(len(self.histories))]
        self.steps.append([(list(h), d) for h, d in zip(self.histories, drafts)])
        return proposal

    def update(self, num_accepted, new_tokens) -> None:
        for history, tokens in zip(self.histories, new_tokens):
            history.extend(tokens)
        self.inner.update(num_accepted, new_tokens)

    def select_rows(self, rows) -> None:
        self.histories = [self.histories[r] for r in rows]
        self.inner.select_rows(rows)


def stale_drafts(recording: Recording, logits_of) -> int:
    """How many recorded greedy drafts differ from a cache-free greedy pass over the committed history (a draft
    cache out of step with the committed tokens shows up here, even when the target's output stays exact).
    ``logits_of(tokens)`` returns ``[len(tokens), V]``. Near-ties of the top two logits are not counted: scoring
    several tokens in one pass rounds differently from one at a time, which can flip them."""
    stale = 0
    for step in recording.steps:
        for history, drafts in step:
            if not drafts:
                continue
            logits = logits_of(history + drafts)[len(history) - 1 : -1]  # [k, V]: the logits each draft followed
            top2 = logits.topk(2, dim=-1).values  # [k, 2]
            wrong = (logits.argmax(dim=-1) != torch.tensor(drafts)) & (top2[:, 0] - top2[:, 1] > 1e-4)
            stale += int(wrong.sum())
    return stale


def _all_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # [T, V]


class FixedDrafter(Drafter):
    """A fake fallback: proposes fixed tokens, records what ``update`` tells it and the thresholds it gets."""

    def __init__(self, tokens: list[list[int]]) -> None:
        self.tokens, self.updates, self.proposals, self.stop_below = tokens, [], 0, []

    def start(self, prompts, sampling, vocab_size) -> None:
        pass

    def propose(self, num_draft_tokens, uniforms, stop_below=None) -> Proposal:
        self.proposals += 1
        self.stop_below.append(stop_below)
        return Proposal(torch.tensor(self.tokens)[:, :num_draft_tokens], None)

    def update(self, num_accepted, new_tokens) -> None:
        self.updates.append(list(num_accepted))

    def select_rows(self, rows) -> None:
        self.tokens = [self.tokens[r] for r in rows]


def test_composite_tells_its_fallback_which_of_its_own_drafts_were_committed() -> None:
    # Rows 0 and 1 match the lookup (it proposes [1, 2, ...] after the repeated 9); row 2 has no match.
    prompts = [[9, 1, 2, 4, 9], [9, 1, 2, 3, 9], [5, 6, 7]]
    fallback = FixedDrafter([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    drafter = CompositeDrafter(NGramDrafter(max_ngram=1), fallback)
    drafter.start(prompts, SamplingParams(), 16)
    proposal = drafter.propose(3, None)
    assert proposal.draft_ids.tolist() == [[1, 2, 4], [1, 2, 3], [1, 2, 3]]  # lookup, lookup, fallback
    assert proposal.draft_lengths.tolist() == [3, 3, 3]
    # Row 0 kept lookup [1, 2] then the target said 5; row 1 kept all 3 and got a bonus; row 2 kept [1] then 8.
    drafter.update([2, 3, 1], [[1, 2, 5], [1, 2, 3, 7], [1, 8]])
    # The fallback's own drafts [1, 2, 3]: row 0 committed [1, 2] of them (they coincide with the lookup's),
    # row 1 all 3 (the last committed token always stays pending), row 2 one, as the verifier said.
    assert fallback.updates == [[2, 3, 1]]
    drafter.propose(3, None)
    assert fallback.proposals == 2  # no row matched this time (the suffixes 5, 3... never occurred before)
    drafter.update([0, 0, 0], [[4], [6], [9]])
    assert fallback.updates[-1] == [0, 0, 0]
    # A lookup row whose committed tokens differ from the fallback's drafts gets 0, not the verifier's count.
    drafter.start([[7, 3, 7], [5, 6]], SamplingParams(), 16)
    fallback.tokens = [[1, 2, 3], [1, 2, 3]]
    assert drafter.propose(2, None).draft_ids.tolist() == [[3, 7], [1, 2]]
    drafter.update([2, 0], [[3, 7, 4], [5]])
    assert fallback.updates[-1] == [0, 0]


def test_composite_proposes_one_hot_rows_for_lookup_rows_when_sampling() -> None:
    prompts = [[4, 1, 4], [5, 6, 7]]
    vocab = 8
    probs = torch.full((2, 2, vocab), 1.0 / vocab)

    class Uniform(FixedDrafter):
        def propose(self, num_draft_tokens, uniforms, stop_below=None) -> Proposal:
            return Proposal(torch.tensor(self.tokens)[:, :num_draft_tokens], probs[:, :num_draft_tokens].clone())

    drafter = CompositeDrafter(NGramDrafter(), Uniform([[3, 3], [2, 2]]))
    drafter.start(prompts, SamplingParams(temperature=1.0), vocab)
    proposal = drafter.propose(2, torch.zeros(2, 2, dtype=torch.float64))
    assert proposal.draft_ids.tolist() == [[1, 4], [2, 2]]
    assert proposal.draft_probs[0].tolist() == torch.eye(vocab)[[1, 4]].tolist()  # one-hot where lookup proposed
    assert torch.equal(proposal.draft_probs[1], probs[1])  # the model's own distributions elsewhere
    assert torch.equal(probs, torch.full((2, 2, vocab), 1.0 / vocab))  # the fallback's tensors are not mutated


@pytest.mark.parametrize("fallback_kind", ["model", "early_exit"])
@pytest.mark.parametrize("kind", KINDS)
def test_composite_fallback_cache_stays_in_step_with_committed_tokens(kind: str, fallback_kind: str) -> None:
    target, partial, _ = pair(kind)
    prompts = [repetitive_prompt(n, seed) for n, seed in EXACTNESS_ROWS]
    if fallback_kind == "model":
        fallback = Recording(ModelDrafter(partial))
        logits_of = functools.partial(_all_logits, partial)
    else:
        fallback = Recording(EarlyExitDrafter(target, 1))

        def logits_of(tokens):
            with truncated_layers(target, 1):
                return _all_logits(target, tokens)

    drafter = CompositeDrafter(NGramDrafter(), fallback)
    out = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4).generate(prompts, max_new_tokens=MAX_NEW)
    assert out.tokens == [list(expected(kind, seed, n)) for n, seed in EXACTNESS_ROWS]
    assert drafter.lookup_rows > 0 and len(fallback.steps) > 0  # both kinds of rows occurred
    # Lookup rows committed tokens the fallback did not draft; its cache must still match the committed text.
    assert stale_drafts(fallback, logits_of) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_composite_skips_the_fallback_when_every_row_matches(kind: str) -> None:
    target, partial, _ = pair(kind)
    base = prompt(4, 90)
    prompts = [base * 4, (base * 4)[1:]]  # both rows match from the first step on
    fallback = Recording(ModelDrafter(partial))
    drafter = CompositeDrafter(NGramDrafter(), fallback)
    out = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3).generate(prompts, max_new_tokens=MAX_NEW)
    assert out.tokens == [reference_greedy(target, p, MAX_NEW) for p in prompts]
    assert drafter.fallback_skipped >= 1
    assert stale_drafts(fallback, functools.partial(_all_logits, partial)) == 0  # caught up after skipped steps


def test_ngram_drafter_skips_drafting_when_nothing_matches() -> None:
    target = pair("gpt2")[0]
    out = SpeculativeDecoder(target, drafter=NGramDrafter(min_ngram=3), num_draft_tokens=3).generate(
        [list(range(1, 12))], max_new_tokens=5
    )
    assert out.tokens[0] == reference_greedy(target, list(range(1, 12)), 5)


# --- Early stops reach the composite's fallback -----------------------------------------------------------------


def test_composite_forwards_early_stop_thresholds_to_its_fallback() -> None:
    fallback = FixedDrafter([[1, 2, 3], [1, 2, 3]])
    drafter = CompositeDrafter(NGramDrafter(max_ngram=1), fallback)
    drafter.start([[5, 6, 7], [8, 9]], SamplingParams(), 16)  # no lookup match: the fallback drafts
    drafter.propose(3, None, [0.25, 0.5])
    assert fallback.stop_below == [[0.25, 0.5]]


class StopRecording(Recording):
    """Records the thresholds each proposal was given and how many blocks came back cut short."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self.thresholds: list[list[float] | None] = []
        self.short_blocks = 0

    def propose(self, num_draft_tokens: int, uniforms, stop_below=None) -> Proposal:
        self.thresholds.append(None if stop_below is None else list(stop_below))
        proposal = super().propose(num_draft_tokens, uniforms, stop_below)
        if proposal.draft_lengths is not None:
            self.short_blocks += int((proposal.draft_lengths < num_draft_tokens).sum())
        return proposal


def test_early_stops_work_for_the_composite_fallback_by_default() -> None:
    """Defaults (auto draft length, early stops on): the composite's model fallback gets the controller's
    thresholds and cuts blocks with them, and the output stays exact."""
    target, partial, _ = pair("llama")
    fallback = StopRecording(ModelDrafter(partial))
    decoder = SpeculativeDecoder(target, drafter=CompositeDrafter(NGramDrafter(), fallback))
    decoder.controller = AlwaysDraft()
    prompts = [prompt(6, 7), prompt(5, 8)]  # random prompts: lookup rarely matches, the fallback drafts
    out = decoder.generate(prompts, max_new_tokens=30)
    assert out.tokens == [reference_greedy(target, p, 30) for p in prompts]
    assert any(t is not None and max(t) > 0 for t in fallback.thresholds), fallback.thresholds
    # Whether the measured thresholds cut a block depends on timings (busy machines differ); with a fixed
    # threshold of 1 the fallback must cut: no block of a random tiny draft is certain.
    fresh = StopRecording(ModelDrafter(partial))
    composite = CompositeDrafter(NGramDrafter(), fresh)
    composite.start(prompts, SamplingParams(), decoder.vocab_size)
    composite.propose(5, None, [1.0, 1.0])
    assert fresh.short_blocks > 0


# --- Filler draft ids from a custom drafter -------------------------------------------------------------------


class FillerDrafter(NGramDrafter):
    """Prompt lookup that fills the unused columns of short proposals with ``filler`` (vLLM uses -1)."""

    def __init__(self, filler: int) -> None:
        super().__init__()
        self.filler = filler

    def propose(self, num_draft_tokens: int, uniforms, stop_below=None) -> Proposal:
        proposal = super().propose(num_draft_tokens, uniforms, stop_below)
        width = proposal.draft_ids.shape[1]
        unused = torch.arange(width) >= proposal.draft_lengths[:, None]  # [B, width]
        proposal.draft_ids = proposal.draft_ids.masked_fill(unused, self.filler)
        return proposal


@pytest.mark.parametrize("filler", [-1, 10**6])
def test_filler_draft_ids_from_a_drafter_change_nothing(filler: int) -> None:
    target = pair("qwen2")[0]
    rows = [(3, 63), (5, 40), (8, 42)]  # repeats: lookup proposes blocks of different lengths per row
    prompts = [repetitive_prompt(n, seed) for n, seed in rows]
    greedy = SpeculativeDecoder(target, drafter=FillerDrafter(filler), num_draft_tokens=GAMMA).generate(
        prompts, max_new_tokens=MAX_NEW
    )
    assert greedy.tokens == [list(expected("qwen2", seed, n)) for n, seed in rows]
    assert greedy.stats.draft_tokens > 0
    settings = dict(max_new_tokens=MAX_NEW, temperature=0.9, seed=3)
    sampled = SpeculativeDecoder(target, drafter=FillerDrafter(filler), num_draft_tokens=GAMMA).generate(
        prompts, **settings
    )
    plain = SpeculativeDecoder(target, drafter=NGramDrafter(), num_draft_tokens=GAMMA).generate(prompts, **settings)
    assert sampled.tokens == plain.tokens and sampled.stats.draft_tokens > 0


# --- fork: a drafter for another batch, on the same weights ------------------------------------------------------


def _models(drafter: Drafter) -> list:
    parts = [drafter.primary, drafter.fallback] if isinstance(drafter, CompositeDrafter) else [drafter]
    return [getattr(part, "model", None) for part in parts]


@pytest.mark.parametrize("name", ["model", "ngram", "early_exit", "composite", "composite_early_exit",
                                  "model_early_stop"])
def test_fork_shares_the_weights_and_starts_without_state(name: str) -> None:
    drafter = make_drafter(name, "llama")
    prompts = [repetitive_prompt(n, seed) for n, seed in EXACTNESS_ROWS]
    drafter.start(prompts, SamplingParams(), 512)
    first = drafter.propose(3, None)
    drafter.update([0] * len(prompts), [[1]] * len(prompts))  # the original moves on
    fork = drafter.fork()
    assert type(fork) is type(drafter) and fork is not drafter
    assert all(a is b for a, b in zip(_models(fork), _models(drafter)))  # no weight is copied
    fork.start(prompts, SamplingParams(), 512)
    again = fork.propose(3, None)
    assert torch.equal(again.draft_ids, first.draft_ids)  # its own state: what the original proposed at first


def test_composite_feeds_its_fallbacks_backlog_in_the_catch_up() -> None:
    """Regression: ``CompositeDrafter`` dropped its fallback's catch-up report, so mixed steps billed the backlog
    pass as draft passes. Its ``backlog`` and ``catch_up`` are now the fallback's (nothing while every row
    matches, when the fallback does not draft), and the proposal after a catch-up feeds no backlog."""
    target, partial, _ = pair("llama")
    fallback = ModelDrafter(partial)
    drafter = CompositeDrafter(NGramDrafter(max_ngram=3, min_ngram=3), fallback)  # no trigram repeats below
    drafter.start([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]], SamplingParams(), partial.config.vocab_size)
    assert drafter.backlog() == fallback.backlog() == (6 - 1) + (5 - 1)
    assert drafter.catch_up() == 9 and drafter.backlog() == fallback.backlog() == 0
    calls = fallback.calls
    drafter.propose(2, None)
    assert fallback.calls - calls == 2  # two draft passes, no catch-up pass
    drafter.update([0, 0], [[20], [30]])
    for t in range(3):  # steps without drafts: the fallback's cache falls behind
        drafter.update([0, 0], [[21 + t], [31 + t]])
    assert drafter.backlog() == fallback.backlog() > 0
    assert drafter.catch_up() > 0 and fallback.backlog() == 0
    base = prompt(4, 90)
    matching = CompositeDrafter(NGramDrafter(), ModelDrafter(partial))
    matching.start([base * 4, (base * 4)[1:]], SamplingParams(), partial.config.vocab_size)
    assert matching.backlog() == 0 and matching.catch_up() == 0  # every row matches: the fallback waits


# --- ModelDrafter with sibling leaves (a tree whose trunk is the chain) ------------------------------------------


def test_sibling_trees_lay_out_the_chain_and_its_most_probable_other_tokens() -> None:
    """k = 5 nodes, two siblings a depth: three chain depths (the chain a plain drafter drafts), each chain node
    followed by the draft's most probable other token there, the last sibling cut by the budget. Greedy rows need no
    probabilities; a sampled batch reports the chain's distributions and one-hot rows for the siblings, and a row
    whose distribution has one token (top-k 1) gets no sibling: a chain."""
    _, partial, _ = pair("llama")
    prompts = [prompt(5, 1), prompt(9, 2)]
    plain = ModelDrafter(partial)
    plain.start(prompts, SamplingParams(), 512)
    chain = plain.propose(3, None).draft_ids  # [B, 3]
    drafter = ModelDrafter(partial, siblings=2)
    drafter.start(prompts, SamplingParams(), 512)
    tree = drafter.propose(5, None)
    assert tree.draft_probs is None and tree.draft_lengths.tolist() == [5, 5]
    assert tree.parents.tolist() == [[-1, -1, 0, 0, 2]] * 2
    assert torch.equal(tree.draft_ids[:, [0, 2, 4]], chain)
    with torch.no_grad():  # the sibling at the root: the draft's second most probable first token
        second = [int(partial(torch.tensor([p])).logits[0, -1, :512].topk(2).indices[1]) for p in prompts]
    assert tree.draft_ids[:, 1].tolist() == second

    sampled = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=1), SamplingParams()]
    prompts.append(prompt(7, 4))
    drafter = ModelDrafter(partial, siblings=2)
    drafter.start(prompts, sampled, 512)
    uniforms = torch.rand(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    uniforms[2] = 0.0  # a greedy row's
    tree = drafter.propose(5, uniforms)
    plain.start(prompts, sampled, 512)
    chain = plain.propose(3, uniforms)
    assert tree.draft_lengths.tolist() == [5, 3, 5]
    assert tree.parents[[0, 2]].tolist() == [[-1, -1, 0, 0, 2]] * 2 and tree.parents[1, :3].tolist() == [-1, 0, 1]
    for b, nodes in ((0, [0, 2, 4]), (1, [0, 1, 2]), (2, [0, 2, 4])):  # the chain, as drawn
        assert torch.equal(tree.draft_ids[b, nodes], chain.draft_ids[b])
        assert torch.allclose(tree.draft_probs[b, nodes], chain.draft_probs[b])
    siblings = tree.draft_ids[[0, 2]][:, [1, 3]]  # [2, 2]
    assert torch.equal(tree.draft_probs[[0, 2]][:, [1, 3]], torch.nn.functional.one_hot(siblings, 512).float())
    assert (siblings != tree.draft_ids[[0, 2]][:, [0, 2]]).all()
    assert int(siblings[0, 0]) == int(chain.draft_probs[0, 0].scatter(0, chain.draft_ids[0, :1], 0.0).argmax())
    with torch.no_grad():  # the greedy row's: its second most probable token, as in an all-greedy batch
        assert int(siblings[1, 0]) == int(partial(torch.tensor([prompts[2]])).logits[0, -1, :512].topk(2).indices[1])


def test_sibling_trees_stop_early_with_their_chain() -> None:
    """An early stop ends a row's chain and its siblings at that depth; every row stopped: no more draft passes."""
    _, partial, _ = pair("llama")
    drafter = ModelDrafter(partial, siblings=3)
    drafter.start([prompt(5, 1), prompt(7, 2)], SamplingParams(), 512)
    tree = drafter.propose(9, None, [1.0, 0.0])  # row 0 stops after its first depth (no probability reaches 1)
    assert tree.draft_lengths.tolist() == [3, 9] and tree.parents[1].tolist() == [-1, -1, -1, 0, 0, 0, 3, 3, 3]
    drafter.update([0, 0], [[1], [1]])
    calls = drafter.calls
    tree = drafter.propose(9, None, [1.0, 1.0])
    assert tree.draft_lengths.tolist() == [3, 3] and drafter.calls - calls == 1


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_an_accepted_sibling_is_pending_not_cached(depth: int) -> None:
    """The accepted path ends in the sibling at ``depth``: the draft's cache keeps the prompt and the chain above
    it, the sibling and the final token are pending, and the next proposal drafts from the committed tokens (the
    draft's own distribution after them; a sibling counted as cached would leave a gap)."""
    _, partial, _ = pair("qwen2")
    context = prompt(6, 3)
    params = SamplingParams(temperature=1.0)
    uniforms = torch.rand(1, 6, generator=torch.Generator().manual_seed(depth), dtype=torch.float64)
    drafter = ModelDrafter(partial, siblings=2)
    drafter.start([context], params, 512)
    tree = drafter.propose(6, uniforms)  # nodes: chain 0, sibling 0, chain 1, sibling 1, chain 2, sibling 2
    assert tree.parents.tolist() == [[-1, -1, 0, 0, 2, 2]]
    path = [*tree.draft_ids[0, [0, 2, 4][:depth]].tolist(), int(tree.draft_ids[0, 2 * depth + 1])]
    drafter.update([depth + 1], [[*path, 7]])
    assert drafter.cached.tolist() == [len(context) + depth] and drafter.pending == [[path[-1], 7]]
    following = drafter.propose(2, uniforms)
    with torch.no_grad():
        expected = torch.softmax(partial(torch.tensor([[*context, *path, 7]])).logits[0, -1, :512], dim=-1)
    assert torch.allclose(following.draft_probs[0, 0], expected, atol=1e-5)
