"""Suffix decoding (``drafters/suffix.py``): drafts from the request's own text and from earlier responses.

Exactness (greedy: token for token the target's own ``generate``, in batches of mixed prompt lengths, with EOS
inside a block and rows joining a running engine batch; sampling: the target's law by chi-square at 1e-6), and
what only this drafter has: responses shared by scope (a key's drafts never come from another key's answers),
first-in-first-out eviction that bounds the caches, only emitted tokens stored (nothing after EOS inside an
accepted block, nothing past the budget), and its hit-rate telemetry. Each test also checks that the
drafter drafted and that drafts were kept, so no test passes on a drafter that never proposes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from stats.chi_square import chi2_pvalue
from tiny_models import build, pair, prompt, reference_greedy, save_word_model

from verispec import SpeculativeDecoder
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.drafters import CompositeDrafter, ModelDrafter, SuffixDrafter
from verispec.drafters.suffix import ResponseTrees, SuffixSettings
from verispec.policy import CapDecision, SpeculationController, bucket_label, bucket_of
from verispec.policy.sources import LOOKUP, MODEL, SourceController, SourceDecision
from verispec.serving.engine import Engine, EngineRequest, FinishEvent, TokensEvent
from verispec.serving.metrics import Metrics

GREEDY = SamplingParams()


def one_row(drafter: SuffixDrafter, text: list[int], params: SamplingParams = GREEDY, k: int = 8) -> list[int]:
    """What ``drafter`` proposes for a new row whose text is ``text`` (the row then ends)."""
    drafter.start([text], params, 512)
    proposed = drafter.lookups(k)[0]
    drafter.select_rows([])
    return proposed


def answer(drafter: SuffixDrafter, text: list[int], response: list[int], params: SamplingParams = GREEDY) -> None:
    """A row that answers ``text`` with ``response`` (committed over two steps) and ends."""
    drafter.start([text], params, 512)
    half = len(response) // 2
    drafter.update([0], [response[:half]])
    drafter.update([0], [response[half:]])
    drafter.select_rows([])


# --- The drafter on its own ---------------------------------------------------------------------------------------


def test_proposes_what_followed_the_longest_match_in_the_rows_own_text() -> None:
    drafter = SuffixDrafter(settings=SuffixSettings(max_spec_offset=0.0))  # vLLM's: length <= match length
    drafter.start([[7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3], [11, 12, 13]], GREEDY, 512)
    proposal = drafter.propose(8, None)
    assert proposal.draft_probs is None  # deterministic: one-hot in the acceptance ratio
    # Row 0 matched [1, 2, 3] (3 tokens): a continuation of at most 3 tokens (max_spec_factor 1). Row 1: nothing.
    assert proposal.draft_lengths.tolist() == [3, 0]
    assert proposal.draft_ids[0, :3].tolist() == [4, 5, 6]
    assert drafter.lookups(2) == [[4, 5], []]
    assert drafter.hits == 1 and drafter.row_steps == 2 and drafter.hit_rate == 0.5


def test_an_offset_lets_a_short_match_draft_four_tokens_more() -> None:
    """``max_spec_offset`` 4 (the factory's where guessed tokens cost little: ``benchmarks/suffix/tune.py``): a
    match of 3 tokens may draft 3 + 4; a match of 1 token, 1 + 4, however long the stored continuation."""
    drafter = SuffixDrafter(settings=SuffixSettings(max_spec_offset=4.0))
    drafter.start([[7, 1, 2, 3, 4, 5, 6, 9, 8, 8, 8, 1, 2, 3], [5, 20, 21, 22, 23, 24, 25, 26, 27, 28, 5]],
                  GREEDY, 512)
    drafts = drafter.drafts()
    assert drafts[0].match_len == 3 and drafts[0].token_ids == [4, 5, 6, 9, 8, 8, 8]
    assert drafts[1].match_len == 1 and drafts[1].token_ids == [20, 21, 22, 23, 24]
    assert drafter.propose(16, None).draft_lengths.tolist() == [7, 5]


def test_ids_the_target_cannot_emit_are_never_proposed() -> None:
    """A prompt may hold ids past the real vocabulary (embedding padding); a continuation stops before them."""
    drafter = SuffixDrafter()
    drafter.start([[1, 2, 3, 600, 4, 9, 1, 2]], GREEDY, 512)
    assert drafter.lookups(8) == [[3]]
    drafter.start([[1, 2, 600, 4, 9, 1, 2]], GREEDY, 512)
    assert drafter.lookups(8) == [[]] and drafter.propose(8, None).draft_lengths.tolist() == [0]


def test_a_longer_match_earns_a_longer_draft_and_rare_branches_end_it() -> None:
    text = list(range(1, 21))
    drafter = SuffixDrafter(settings=SuffixSettings(max_spec_offset=0.0))
    assert one_row(drafter, [99] + text + [50] + text[:2], k=16) == [3, 4]  # matched 2 tokens: 2 drafted
    assert one_row(drafter, [99] + text + [50] + text[:6], k=16) == list(range(7, 13))  # matched 6: 6 drafted
    offset = SuffixDrafter(settings=SuffixSettings(max_spec_offset=4.0))  # offset 4: 2 + 4, 6 + 4
    assert one_row(offset, [99] + text + [50] + text[:2], k=16) == list(range(3, 9))
    assert one_row(offset, [99] + text + [50] + text[:6], k=16) == list(range(7, 17))
    # After [1, 2]: 3 three times, 8 once (estimated 0.75 / 0.25); with min_token_prob 0.5 the draft stops there.
    branching = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 8, 0, 1, 2]
    strict = SuffixDrafter(settings=SuffixSettings(min_token_prob=0.5, max_spec_factor=4.0))
    assert one_row(strict, branching)[:1] == [3]
    assert one_row(SuffixDrafter(settings=SuffixSettings(min_token_prob=0.9)), branching) == []


def test_earlier_responses_are_drafted_from_in_the_same_scope_only() -> None:
    question, response = [5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47]
    follow_up = [9, 9, 40, 41, 42, 43]  # quotes the start of the earlier response
    for scope in ("global", "key", "request"):
        drafter = SuffixDrafter(scope=scope)
        answer(drafter, question, response, SamplingParams(draft_scope="tenant A"))
        same_key = one_row(drafter, follow_up, SamplingParams(draft_scope="tenant A"))
        other_key = one_row(drafter, follow_up, SamplingParams(draft_scope="tenant B"))
        assert same_key == ([] if scope == "request" else [44, 45, 46, 47])
        assert other_key == ([44, 45, 46, 47] if scope == "global" else [])


def test_sampled_rows_draft_from_their_own_text_unless_shared() -> None:
    """A sampled row's tokens depend on its drafts: drafts from other requests would make a seed's output depend
    on what ran before it."""
    sampled = SamplingParams(temperature=0.8)
    for share, expected in ((False, []), (True, [44, 45, 46, 47])):
        drafter = SuffixDrafter(share_sampled=share)
        answer(drafter, [5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47], sampled)  # its answer still enters the tree
        assert one_row(drafter, [9, 9, 40, 41, 42, 43], sampled) == expected
        assert one_row(drafter, [9, 9, 40, 41, 42, 43]) == [44, 45, 46, 47]  # greedy rows read it


def test_rows_join_and_leave_with_their_own_text() -> None:
    drafter = SuffixDrafter(scope="request", settings=SuffixSettings(max_spec_offset=0.0))  # length = match length
    drafter.start([[1, 2, 3, 1, 2]], GREEDY, 512)
    drafter.add_rows([[4, 5, 6, 4, 5], [8, 9]], [GREEDY, GREEDY])
    assert drafter.lookups(4) == [[3, 1], [6, 4], []]
    drafter.update([0, 0, 0], [[3], [7], [8]])
    drafter.select_rows([2, 0])  # the middle row ends; the others keep their own text
    assert drafter.lookups(4) == [[9], [1, 2, 3]]  # [8] matched: one token; [1, 2, 3] matched: three


def test_nothing_after_a_rows_stop_token_enters_the_caches() -> None:
    """An accepted block may run past EOS (the drafts after it were scored too): the row emits up to and including
    its EOS, and only that enters its scope's cache, whatever is committed after it."""
    eos = 99
    drafter = SuffixDrafter()
    drafter.start([[5, 6, 7], [8, 6, 7]], SamplingParams(stop_token_ids=(eos, 98)), 512)
    drafter.update([1, 0], [[40, 41], [60]])
    drafter.update([5, 2], [[42, 43, eos, 44, 45, 46], [61, 62, 98]])  # a block past EOS; a bonus stop token
    drafter.update([1, 0], [[47, 48], [63]])  # a batch drops ended rows first: still nothing of this
    assert drafter.trees.size() == {"scopes": 1, "responses": 2, "tokens": 5 + 4, "running": 2}
    drafter.select_rows([])
    assert drafter.trees.size() == {"scopes": 1, "responses": 2, "tokens": 5 + 4, "running": 0}
    assert one_row(drafter, [9, 9, 41, 42, 43]) == [eos]  # the response ends at its EOS
    assert one_row(drafter, [9, 9, 60, 61, 62]) == [98]


def test_forks_share_the_responses_and_nothing_else() -> None:
    drafter = SuffixDrafter()
    fork = drafter.fork()
    assert fork.trees is drafter.trees and fork.settings == drafter.settings
    answer(fork, [1, 2, 3], [30, 31, 32, 33, 34, 35])
    assert one_row(drafter, [8, 30, 31, 32]) == [33, 34, 35]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="scope"):
        SuffixDrafter(scope="tenant")
    with pytest.raises(ValueError, match="cache_size"):
        SuffixDrafter(cache_size=-1)
    with pytest.raises(ValueError):
        SuffixSettings(min_token_prob=1.5)


# --- Eviction bounds the trees --------------------------------------------------------------------------------------


def test_the_oldest_responses_are_evicted_first_and_the_trees_stay_bounded() -> None:
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(1, 500, (60,), generator=generator).tolist() for _ in range(40)]
    bounded, unbounded = SuffixDrafter(cache_size=4), SuffixDrafter(cache_size=1000)
    for i, response in enumerate(responses):
        for drafter in (bounded, unbounded):
            answer(drafter, [1, 2, i], response)
        assert bounded.trees.size() == {"scopes": 1, "responses": min(i + 1, 4), "tokens": 60 * min(i + 1, 4),
                                        "running": 0}
    assert bounded.trees.evicted == 36
    # The unbounded cache keeps every response (the prompts are in no scope's cache: only responses are).
    assert unbounded.trees.size() == {"scopes": 1, "responses": 40, "tokens": 40 * 60, "running": 0}
    assert unbounded.trees.evicted == 0
    # The oldest went first: the last response drafts, the first no longer does.
    assert one_row(bounded, [7] + responses[-1][:8])[:3] == responses[-1][8:11]
    assert one_row(bounded, [7] + responses[0][:8])[:2] != responses[0][8:10]  # at most a chance one-token match


def test_a_long_run_through_the_decoder_keeps_the_cap() -> None:
    target = pair("llama")[0]
    drafter = SuffixDrafter(cache_size=3)
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    for i in range(8):
        decoder.generate([prompt(6, i), prompt(9, 100 + i)], max_new_tokens=12)
        size = drafter.trees.size()
        assert size["responses"] <= 3 and size["tokens"] <= 3 * 12 and size["running"] == 0
    assert drafter.trees.evicted == 16 - 3


def test_the_cap_counts_every_scopes_responses_together() -> None:
    drafter = SuffixDrafter(cache_size=3, scope="key")
    for i in range(10):
        answer(drafter, [1, 2], [20 + i, 21, 22, 23], SamplingParams(draft_scope=("key", i)))
        assert drafter.trees.size()["responses"] == min(i + 1, 3)
    assert drafter.trees.size()["scopes"] == 10 and drafter.trees.evicted == 7
    assert one_row(drafter, [5, 29, 21], SamplingParams(draft_scope=("key", 9))) == [22, 23]
    assert one_row(drafter, [5, 20, 21], SamplingParams(draft_scope=("key", 0))) == []  # evicted


def test_a_scope_limit_drops_the_least_recently_used_tree() -> None:
    trees = ResponseTrees(cache_size=8, max_scopes=2)
    drafter = SuffixDrafter(scope="key", trees=trees)
    for key in ("a", "b", "a", "c"):
        answer(drafter, [1, 2], [20, 21, 22, 23], SamplingParams(draft_scope=key))
    assert trees.size()["scopes"] == 2  # "b" went: "a" was used after it
    assert one_row(drafter, [5, 20, 21], SamplingParams(draft_scope="a")) == [22, 23]
    assert one_row(drafter, [5, 20, 21], SamplingParams(draft_scope="b")) == []


# --- Exactness: greedy --------------------------------------------------------------------------------------------

MAX_NEW = 17  # not a multiple of the draft length


def repetitive_prompt(length: int, seed: int) -> list[int]:
    base = prompt(length, seed)
    return base + base + base[: length // 2]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_output_is_the_targets_in_a_batch_of_mixed_lengths(kind: str) -> None:
    target = pair(kind)[0]
    prompts = [repetitive_prompt(n, seed) for n, seed in ((3, 63), (5, 40), (8, 42))]
    drafter = SuffixDrafter()
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    expected = [reference_greedy(target, p, MAX_NEW) for p in prompts]
    first = decoder.generate(prompts, max_new_tokens=MAX_NEW)
    assert first.tokens == expected and first.finish_reasons == ["length"] * 3
    assert first.stats.draft_tokens > 0 and first.stats.acceptance_rate > 0.0
    # The same prompts again: the earlier answers are in the tree, so drafts come from them and are kept.
    hits = drafter.response_hits
    again = decoder.generate(prompts, max_new_tokens=MAX_NEW)
    assert again.tokens == expected
    assert drafter.response_hits > hits and again.stats.acceptance_rate > first.stats.acceptance_rate


def test_eos_inside_an_accepted_block_ends_the_row_there() -> None:
    target = pair("llama")[0]
    prompts = [repetitive_prompt(5, 40), repetitive_prompt(8, 42)]
    full = [reference_greedy(target, p, MAX_NEW) for p in prompts]
    eos = full[0][9]  # a token the first row emits mid-way
    drafter = SuffixDrafter()
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=6)
    first = decoder.generate(prompts, max_new_tokens=MAX_NEW)  # the answers enter the cache: long blocks accepted
    out = decoder.generate(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos)
    # The cache holds what the rows emitted, no token drafted and accepted after an EOS.
    emitted = sum(map(len, first.tokens + out.tokens))
    assert drafter.trees.size() == {"scopes": 1, "responses": 4, "tokens": emitted, "running": 0}
    alone = decoder.generate(prompts, max_new_tokens=MAX_NEW, eos_token_id=eos, draft=None)
    assert out.tokens == alone.tokens and out.finish_reasons == alone.finish_reasons
    first_eos = full[0].index(eos)
    assert out.tokens[0] == full[0][: first_eos + 1] and out.finish_reasons[0] == "stop"
    assert out.stats.acceptance_rate > 0.5  # the EOS came inside long accepted blocks


def test_a_block_that_would_pass_the_budget_enters_the_cache_cut_at_it() -> None:
    """Rows whose whole answer is in the cache accept full blocks; MAX_NEW is not a multiple of the block, so the
    last block meets the budget: the cache holds each answer once, exactly as emitted."""
    target = pair("llama")[0]
    prompts = [repetitive_prompt(5, 40), repetitive_prompt(8, 42)]
    drafter = SuffixDrafter()
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=6)
    # No measured pass cost: every row drafts its fixed length (within its budget), whatever the machine's load.
    decoder.controller = SpeculationController()
    first = decoder.generate(prompts, max_new_tokens=MAX_NEW)
    out = decoder.generate(prompts, max_new_tokens=MAX_NEW)  # drafted from the first answers
    assert out.tokens == first.tokens and [len(t) for t in out.tokens] == [MAX_NEW, MAX_NEW]
    assert out.stats.acceptance_rate > 0.5 and out.stats.steps <= 6  # long blocks, 17 tokens in at most 6 steps
    assert drafter.trees.size() == {"scopes": 1, "responses": 4, "tokens": 4 * MAX_NEW, "running": 0}


def test_a_row_that_fails_leaves_nothing_in_the_cache() -> None:
    """A row whose target logits turn NaN ends with nothing emitted at that step: none of the step's tokens (the
    verifier's output on zeroed logits) enter its scope's cache; the healthy row's answer does, exactly."""
    from verispec import NonFiniteLogitsError

    target = build("llama", seed=7)
    poison = 3
    with torch.no_grad():
        target.get_input_embeddings().weight[poison] = float("nan")
    good, bad = repetitive_prompt(5, 40), [poison] + repetitive_prompt(6, 41)
    assert poison not in good
    drafter = SuffixDrafter()
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    with pytest.raises(NonFiniteLogitsError) as caught:
        decoder.generate([good, bad], max_new_tokens=MAX_NEW)
    out = caught.value.output
    assert out.finish_reasons == ["length", "error"] and out.tokens[1] == []
    assert out.tokens[0] == reference_greedy(target, good, MAX_NEW)
    assert drafter.trees.size() == {"scopes": 1, "responses": 2, "tokens": MAX_NEW, "running": 0}


def test_suffix_then_model_composite_is_exact_and_uses_both() -> None:
    target, partial, _ = pair("llama")
    prompts = [repetitive_prompt(n, seed) for n, seed in ((3, 63), (8, 42))] + [prompt(6, 5)]
    drafter = CompositeDrafter(SuffixDrafter(settings=SuffixSettings(min_score=2.0)), ModelDrafter(partial))
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    for _ in range(2):
        out = decoder.generate(prompts, max_new_tokens=MAX_NEW)
        assert out.tokens == [reference_greedy(target, p, MAX_NEW) for p in prompts]
    assert drafter.lookup_rows > 0 and drafter.fallback.calls > 0 and drafter.fallback_skipped > 0


class _Alternating(SourceController):
    """Runs the lookup plan and the model plan in turn, whatever they cost (so a test sees both, and rows of
    both sources in one step): in lookup steps a row drafts its continuation if it has one, else nothing; in
    model steps even rows draft their continuation if they have one, the others the model's drafts."""

    def __init__(self) -> None:
        super().__init__()
        self.turn = 0

    def decide_sources(self, rows, backlog=0) -> SourceDecision:
        self.turn += 1
        plan = MODEL if self.turn % 2 else LOOKUP
        sources, lengths = [], []
        for b, r in enumerate(rows):
            if plan == LOOKUP:
                source = LOOKUP if r.lookup_length else None
            else:
                source = LOOKUP if r.lookup_length and b % 2 == 0 else MODEL
            sources.append(source if r.limit else None)
            lengths.append(0 if not r.limit or source is None else
                           min(r.limit, r.lookup_length) if source == LOOKUP else r.limit)
        size = len(rows)
        return SourceDecision(lengths, sources, plan, CapDecision(max(lengths), "pays", size,
                                                                  bucket_label(bucket_of(size)), tokens=float(size)))


def _sources_add_up(stats) -> None:
    """Per-drafter telemetry sums to the totals; a lookup's hits are at most the rows that asked it."""
    assert sum(c.draft_tokens for c in stats.sources.values()) == stats.draft_tokens
    assert sum(c.accepted_tokens for c in stats.sources.values()) == stats.accepted_tokens
    for counts in stats.sources.values():
        assert counts.hits <= counts.consulted and counts.drafts <= counts.draft_tokens


@pytest.mark.parametrize("controller", ["measured", "alternating"])
def test_each_rows_source_chosen_per_step_keeps_the_greedy_output(controller: str) -> None:
    # "auto": the decoder's source controller chooses each row's source (lookup, model or none) from what it
    # measures; the alternating one forces lookup steps (the model idle, then catching up) and mixed steps.
    target, partial, _ = pair("llama")
    prompts = [repetitive_prompt(n, seed) for n, seed in ((3, 63), (8, 42))] + [prompt(6, 5)]
    drafter = CompositeDrafter(SuffixDrafter(), ModelDrafter(partial))
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens="auto")
    assert isinstance(decoder.controller, SourceController)
    if controller == "alternating":
        decoder.controller = _Alternating()
    runs = []
    for _ in range(2):  # the second run finds the first's answers in the tree
        out = decoder.generate(prompts, max_new_tokens=MAX_NEW)
        assert out.tokens == [reference_greedy(target, p, MAX_NEW) for p in prompts]
        _sources_add_up(out.stats)
        assert out.stats.sources["suffix"].consulted > 0 and out.stats.sources["suffix"].hits > 0
        runs.append(out.stats.sources)
    if controller == "alternating":
        assert runs[0]["model"].draft_tokens > 0 and runs[0]["suffix"].accepted_tokens > 0
        assert drafter.fallback_skipped > 0 and drafter.fallback.calls > 0
    else:
        assert sum(decoder.controller.snapshot()["plans"].values()) > 0


def test_suffix_alone_reports_its_hit_rate_acceptance_and_draft_length() -> None:
    target = pair("llama")[0]
    decoder = SpeculativeDecoder(target, drafter=SuffixDrafter(), num_draft_tokens=4)
    out = decoder.generate([repetitive_prompt(5, 40), prompt(6, 5)], max_new_tokens=MAX_NEW)
    counts = out.stats.sources["suffix"]
    assert set(out.stats.sources) == {"suffix"}
    assert counts.draft_tokens == out.stats.draft_tokens > 0 and counts.accepted_tokens == out.stats.accepted_tokens
    assert 0 < counts.hits < counts.consulted  # the random prompt's row finds nothing at first
    summary = out.stats.to_dict()["sources"]["suffix"]
    assert summary["hit_rate"] == counts.hits / counts.consulted
    assert summary["mean_draft_length"] == counts.draft_tokens / counts.drafts
    assert summary["acceptance_rate"] == counts.accepted_tokens / counts.draft_tokens


def test_generate_scope_keeps_one_callers_answers_from_anothers_drafts() -> None:
    target = pair("llama")[0]
    drafter = SuffixDrafter(scope="key")
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4)
    question = [prompt(6, 21)]
    first = decoder.generate(question, max_new_tokens=MAX_NEW, draft_scope="A")
    hits = drafter.response_hits
    other = decoder.generate(question, max_new_tokens=MAX_NEW, draft_scope="B")
    assert drafter.response_hits == hits  # B's tree holds nothing of A's answer
    same = decoder.generate(question, max_new_tokens=MAX_NEW, draft_scope="A")
    assert drafter.response_hits > hits  # A's own earlier answer drafts A's
    assert first.tokens == other.tokens == same.tokens
    assert same.stats.accepted_tokens > other.stats.accepted_tokens and same.stats.steps < other.stats.steps


class _Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.started, self.done = threading.Event(), threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, TokensEvent):
            self.tokens.extend(event.tokens)
            self.started.set()
        else:
            self.finish = event
            self.done.set()


def _submit(engine: Engine, request: EngineRequest) -> _Collector:
    collector = _Collector()
    engine.submit(request, collector)
    return collector


def test_rows_joining_a_running_engine_batch_keep_their_greedy_output() -> None:
    target = pair("qwen2")[0]
    drafter = SuffixDrafter()
    engine = Engine(SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4), max_batch_size=3)
    engine.start()
    try:
        requests = [EngineRequest(repetitive_prompt(4 + i, 70 + i), max_new_tokens=30 + 3 * i) for i in range(5)]
        first = _submit(engine, requests[0])
        assert first.started.wait(60)  # running and has emitted tokens: the others join mid-run
        rest = [_submit(engine, r) for r in requests[1:]]
        again = None
        for i, c in enumerate([first] + rest):
            assert c.done.wait(120) and c.finish.reason == "length"
            assert c.tokens == reference_greedy(target, requests[i].prompt_ids, requests[i].max_new_tokens)
            if i == 0:
                again = _submit(engine, requests[0])  # joins while the others run; its answer is in the tree
        assert again.done.wait(120) and again.tokens == first.tokens
        metrics = engine.metrics()
        assert metrics["draft_tokens"] > 0 and metrics["accepted_tokens"] > 0
        assert drafter.response_hits > 0
        # Every row that left wrote its whole answer into the global tree (drafted from by rows joining later).
        outputs = [c.tokens for c in [first] + rest + [again]]
        assert drafter.trees.size() == {"scopes": 1, "responses": 6, "tokens": sum(map(len, outputs)), "running": 0}
        # Per-drafter telemetry: each request's finish stats, the engine's totals, /metrics by drafter.
        assert metrics["sources"]["suffix"]["draft_tokens"] == metrics["draft_tokens"]
        assert metrics["sources"]["suffix"]["hits"] > 0
        served = Metrics(engine.metrics, lambda: 0)
        for c in [first] + rest + [again]:
            assert c.finish.stats.sources["suffix"].draft_tokens == c.finish.stats.draft_tokens
            served.count_engine_finish(c.finish.reason, c.finish.stats)
        text = served.render().decode()
        assert f'verispec_drafter_draft_tokens_total{{drafter="suffix"}} {float(metrics["draft_tokens"])}' in text
        assert 'verispec_drafter_hits_total{drafter="suffix"}' in text
    finally:
        engine.shutdown()


def test_a_seeded_sampled_request_gives_the_same_tokens_after_other_requests() -> None:
    target = pair("qwen2")[0]
    engine = Engine(SpeculativeDecoder(target, drafter=SuffixDrafter(), num_draft_tokens=3), max_batch_size=4)
    engine.start()
    try:
        request = EngineRequest(repetitive_prompt(5, 3), max_new_tokens=20, temperature=0.8, seed=7)
        alone = _submit(engine, request)
        assert alone.done.wait(60)
        others = [_submit(engine, EngineRequest(repetitive_prompt(5, 3), max_new_tokens=25)) for _ in range(2)]
        crowded = _submit(engine, request)
        for c in others + [crowded]:
            assert c.done.wait(60)
        assert crowded.tokens == alone.tokens and alone.finish.stats.draft_tokens > 0
        assert alone.finish.reason == crowded.finish.reason == "length" and len(alone.tokens) == 20
    finally:
        engine.shutdown()


# --- Isolation through the engine: tenant B's drafts never hold what only tenant A's answers do ----------------


class _Recording(SuffixDrafter):
    """Records each row's text and proposal at every step."""

    def start(self, prompts, sampling, vocab_size) -> None:
        self.texts, self.keys = [], []  # SuffixDrafter.start adds the rows through add_rows
        self.proposed: list[tuple[object, list[int], list[int]]] = getattr(self, "proposed", [])
        super().start(prompts, sampling, vocab_size)

    def add_rows(self, prompts, sampling) -> None:
        self.texts += [list(p) for p in prompts]
        self.keys += [p.draft_scope for p in sampling]
        super().add_rows(prompts, sampling)

    def lookups(self, num_draft_tokens, min_score=None):
        self.consulted = getattr(self, "consulted", set()) | set(self.keys)  # the scopes the batch asked about
        return super().lookups(num_draft_tokens, min_score)

    def propose(self, num_draft_tokens, uniforms, stop_below=None):
        proposal = super().propose(num_draft_tokens, uniforms, stop_below)
        for b, (text, key) in enumerate(zip(self.texts, self.keys)):
            length = int(proposal.draft_lengths[b])
            self.proposed.append((key, list(text), proposal.draft_ids[b, :length].tolist()))
        return proposal

    def update(self, num_accepted, new_tokens) -> None:
        for text, tokens in zip(self.texts, new_tokens):
            text.extend(tokens)
        super().update(num_accepted, new_tokens)

    def select_rows(self, rows) -> None:
        self.texts = [self.texts[r] for r in rows]
        self.keys = [self.keys[r] for r in rows]
        super().select_rows(rows)


def _continues_in(text: list[int], draft: list[int]) -> bool:
    """Whether ``draft`` follows some occurrence, earlier in ``text``, of the token ``text`` ends with."""
    return any(text[i] == text[-1] and text[i + 1 : i + 1 + len(draft)] == draft for i in range(len(text) - 1))


@pytest.mark.parametrize("scope", ["key", "global"])
def test_with_scope_key_a_tenants_drafts_never_come_from_another_tenants_answers(scope: str) -> None:
    target = pair("qwen2")[0]
    drafter = _Recording(scope=scope)
    engine = Engine(SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=4), max_batch_size=4)
    engine.start()
    try:
        question = prompt(6, 21)
        a = _submit(engine, EngineRequest(question, max_new_tokens=30, draft_scope="A"))
        assert a.done.wait(60)
        # Tenant B asks the same question: only tenant A's answer holds its continuation.
        b = _submit(engine, EngineRequest(question, max_new_tokens=30, draft_scope="B"))
        assert b.done.wait(60) and b.tokens == a.tokens  # drafts never change the output
        assert a.finish.reason == b.finish.reason == "length" and len(a.tokens) == 30
    finally:
        engine.shutdown()
    b_drafts = [(text, draft) for key, text, draft in drafter.proposed if key == "B" and draft]
    foreign = [(text, draft) for text, draft in b_drafts if not _continues_in(text, draft)]
    assert b_drafts  # B drafted (from its own text, where its answer repeats itself)
    if scope == "key":
        assert not foreign  # every draft B saw continues B's own text
    else:  # the control: with one global tree, B drafts the rest of A's answer once it has begun it
        assert foreign


def test_the_engine_passes_each_requests_scope_to_the_drafter() -> None:
    target = pair("qwen2")[0]
    drafter = _Recording(scope="key")
    engine = Engine(SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=2), max_batch_size=4)
    engine.start()
    try:
        done = [_submit(engine, EngineRequest(prompt(5, i), max_new_tokens=4, draft_scope=("key", i % 2)))
                for i in range(3)]
        for c in done:
            assert c.done.wait(60) and c.finish.reason == "length"
    finally:
        engine.shutdown()
    assert drafter.consulted == {("key", 0), ("key", 1)}  # random prompts: looked up, nothing found to propose


# --- Sampling: the emitted tokens follow the target's law -----------------------------------------------------------
# As tests/stats/test_drafter_law.py: a tiny Qwen2 over 8 tokens, two contexts in one batch of 8000 rows each, the
# joint law of the first three tokens per context by chi-square at 1e-6 (fixed seed). With ``share_sampled`` every
# row drafts from its own text and from the answers of the rows before it, so drafts are often long and often wrong.
# The cache keeps every answer: a running row holds a slot from its start, so a batch larger than the cache would
# evict every earlier answer before its first draft.

SMALL_VOCAB = 8
CONTEXTS = ([1, 5, 2, 1, 5], [3, 6, 4, 7])
ROWS_PER_CONTEXT = 8000
NEW = 3
EVERY_ANSWER = 2 * ROWS_PER_CONTEXT + 200


def _token_law(model, context: list[int], params: SamplingParams, length: int) -> np.ndarray:
    with torch.no_grad():
        first = probs_from_logits(model(torch.tensor([context])).logits[0, -1], params).double().numpy()  # [V]
    if length == 1:
        return first
    rest = np.stack([_token_law(model, context + [t], params, length - 1) for t in range(SMALL_VOCAB)])
    return first.reshape((SMALL_VOCAB,) + (1,) * (length - 1)) * rest


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.5, top_k=4)])
def test_sampled_tokens_follow_the_target_law(settings) -> None:
    target = build("qwen2", seed=3, vocab_size=SMALL_VOCAB)
    drafter = SuffixDrafter(EVERY_ANSWER, share_sampled=True,
                            settings=SuffixSettings(min_token_prob=0.0, max_spec_offset=1.0))
    prompts = [CONTEXTS[0]] * ROWS_PER_CONTEXT + [CONTEXTS[1]] * ROWS_PER_CONTEXT
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3)
    decoder.generate(prompts[:200], max_new_tokens=NEW, seed=5, **settings)  # earlier answers in the tree
    out = decoder.generate(prompts, max_new_tokens=NEW, seed=11, **settings)
    assert out.stats.draft_tokens > ROWS_PER_CONTEXT and drafter.response_hits > 0
    assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats.acceptance_rate  # kept and rejected drafts
    params = SamplingParams(**settings)
    for c, context in enumerate(CONTEXTS):
        law = _token_law(target, context, params, NEW)
        counts = np.zeros((SMALL_VOCAB,) * NEW)
        for tokens in out.tokens[c * ROWS_PER_CONTEXT : (c + 1) * ROWS_PER_CONTEXT]:
            counts[tuple(tokens)] += 1
        p_value = chi2_pvalue(counts, law, min_expected=20)
        assert p_value > 1e-6, (context, p_value)


# --- Wiring: the factory, the command line and the server's key identity -------------------------------------------


WORD_MODEL_WORDS = ["<unk>", "<s>", "</s>"] + "def return x y ( ) : + - 1 2 if else for in print".split()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("suffix-models")
    return {"target": save_word_model(root / "target", WORD_MODEL_WORDS, 0),
            "draft": save_word_model(root / "draft", WORD_MODEL_WORDS, 1)}


def test_load_builds_the_suffix_drafter_alone_and_before_a_model(saved) -> None:
    from verispec import load

    decoder, _ = load(saved["target"], "suffix", suffix_cache_size=7, suffix_scope="key")
    assert isinstance(decoder.drafter, SuffixDrafter)
    assert decoder.drafter.trees.cache_size == 7 and decoder.drafter.scope_mode == "key"
    decoder, _ = load(saved["target"], "suffix+" + saved["draft"], draft_quant="none")
    assert isinstance(decoder.drafter, CompositeDrafter) and isinstance(decoder.drafter.fallback, ModelDrafter)
    assert decoder.drafter.primary.settings.min_score == 3.0 and decoder.drafter.primary.scope_mode == "global"


def test_bad_suffix_options_are_refused_before_loading() -> None:
    from verispec.factory import check_load_options

    with pytest.raises(ValueError, match="after 'suffix\\+'"):
        check_load_options("/no/such/model", "suffix+")
    with pytest.raises(ValueError, match="scope"):
        check_load_options("/no/such/model", "suffix", suffix_scope="everyone")
    with pytest.raises(ValueError, match="suffix_cache_size"):
        check_load_options("/no/such/model", "suffix", suffix_cache_size=-1)


def test_generate_with_suffix_drafts_equals_the_target_alone(saved, capsys) -> None:
    import json

    from verispec.cli import main

    common = ["generate", "--target", saved["target"], "--prompt", "def x ( y ) : return x ( y ) + x ( y",
              "--max-new-tokens", "12", "--json", "--num-draft-tokens", "3"]
    outputs = {}
    for draft in ("none", "suffix", "suffix+" + saved["draft"]):
        assert main([*common, "--draft", draft, "--suffix-cache-size", "5"]) == 0
        outputs[draft] = json.loads(capsys.readouterr().out)
    assert outputs["suffix"]["tokens"] == outputs["none"]["tokens"] == outputs["suffix+" + saved["draft"]]["tokens"]
    assert outputs["suffix"]["stats"]["draft_tokens"] > 0


def test_serve_scopes_suffix_drafts_by_key_when_keys_are_set(saved, monkeypatch) -> None:
    from verispec import cli
    from verispec.cli import commands, common

    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    seen = []

    def capture(args, progress=None):
        seen.append(common.suffix_options(args))
        raise cli.CliError("stop here")

    monkeypatch.setattr(commands, "build_decoder", capture)
    base = ["serve", "--target", saved["target"], "--draft", "suffix"]
    for extra in (["--api-key", "k1"], [], ["--api-key", "k1", "--suffix-scope", "global"]):
        assert cli.main(base + extra) == 2
    assert [s["suffix_scope"] for s in seen] == ["key", "global", "global"]


def test_the_guard_tells_the_app_which_key_authorised_a_request() -> None:
    import asyncio

    from verispec.serving.guard import API_KEY, Guard

    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope.get(API_KEY))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(key: str | None) -> None:
        headers = [(b"host", b"localhost")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
        scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}

        async def send(message) -> None:
            pass

        await guard(scope, None, send)

    guard = Guard(app, api_keys=["first", "second"], metrics_public=False, max_request_bytes=100,
                  count=lambda path, status: None)
    for key in ("second", "first", "wrong", None):
        asyncio.run(call(key))
    assert seen == [1, 0]  # the refused requests never reach the app


def test_verispec_batch_with_suffix_drafts_writes_the_target_alones_tokens(saved, tmp_path) -> None:
    import json

    from verispec.offline.job import run_batch
    from verispec.offline.worker import JobDefaults

    texts = ["def x ( y ) : return x ( y ) + x ( y", "if x : print ( x ) else : print ( y ) if x :",
             "for x in y : print ( x ) for x in y :", "def y ( x ) : return y ( x ) - y ( x"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = {}
    for name, draft in ((None, None), ("suffix", "suffix"), ("composite", "suffix+" + saved["draft"])):
        path = tmp_path / f"{name}.jsonl"
        run_batch(saved["target"], draft, input_path=source, output_path=path, batch_size=2,
                  defaults=JobDefaults(max_tokens=12), progress=False, fast=False, suffix_cache_size=3)
        out[name] = {row["input_index"]: row for row in map(json.loads, path.read_text().splitlines())}
    for name in ("suffix", "composite"):
        assert [out[name][i]["tokens"] for i in range(4)] == [out[None][i]["tokens"] for i in range(4)]
        assert sum(row["verispec"]["draft_tokens"] for row in out[name].values()) > 0


def test_sampled_tokens_follow_the_target_law_with_lookup_and_model_rows_in_one_step() -> None:
    # Lookup rows (one-hot drafts) and model rows (the draft's distributions) verified in the same steps, and
    # lookup-only steps where the model idles: each row's tokens still follow the target's law.
    target, draft = build("qwen2", seed=3, vocab_size=SMALL_VOCAB), build("qwen2", seed=4, vocab_size=SMALL_VOCAB)
    lookup = SuffixDrafter(EVERY_ANSWER, share_sampled=True,
                            settings=SuffixSettings(min_token_prob=0.0, max_spec_offset=1.0))
    drafter = CompositeDrafter(lookup, ModelDrafter(draft))
    decoder = SpeculativeDecoder(target, drafter=drafter, num_draft_tokens=3)
    decoder.controller = _Alternating()
    prompts = [CONTEXTS[0]] * ROWS_PER_CONTEXT + [CONTEXTS[1]] * ROWS_PER_CONTEXT
    decoder.generate(prompts[:200], max_new_tokens=NEW, seed=5, temperature=1.0)  # earlier answers in the tree
    out = decoder.generate(prompts, max_new_tokens=NEW, seed=11, temperature=1.0)
    sources = out.stats.sources
    assert sources["suffix"].draft_tokens > ROWS_PER_CONTEXT and sources["model"].draft_tokens > ROWS_PER_CONTEXT
    for counts in sources.values():
        assert 0.05 < counts.accepted_tokens / counts.draft_tokens < 0.95  # kept and rejected drafts
    law_params = SamplingParams(temperature=1.0)
    for c, context in enumerate(CONTEXTS):
        law = _token_law(target, context, law_params, NEW)
        counts = np.zeros((SMALL_VOCAB,) * NEW)
        for tokens in out.tokens[c * ROWS_PER_CONTEXT : (c + 1) * ROWS_PER_CONTEXT]:
            counts[tuple(tokens)] += 1
        p_value = chi2_pvalue(counts, law, min_expected=20)
        assert p_value > 1e-6, (context, p_value)


def test_drafts_reach_as_far_as_their_evidence_unless_guesses_are_cheap() -> None:
    """By default a continuation is at most its match long (vLLM's offset 0); the factory lets it guess 4 tokens
    more only beside a target where a pass of 5 tokens costs under 1.5 one-token passes (a CPU torch target), not
    where each token costs ~0.6 of a pass (llama.cpp on a CPU, measured)."""
    from verispec.factory import suffix_settings
    from verispec.models.pass_cost import PassCostCurve

    drafter = SuffixDrafter()
    drafter.start([[7, 1, 2, 3, 4, 5, 6, 9, 8, 8, 8, 1, 2, 3]], GREEDY, 512)
    assert drafter.drafts()[0].token_ids == [4, 5, 6]
    llama_cpu = PassCostCurve((1, 2, 4, 8, 16, 32), (0.028, 0.045, 0.070, 0.122, 0.135, 0.161))
    torch_cpu = PassCostCurve((1, 2, 4, 8, 16, 32), (0.050, 0.051, 0.053, 0.058, 0.080, 0.120))
    assert suffix_settings(llama_cpu).max_spec_offset == 0.0 and suffix_settings(torch_cpu).max_spec_offset == 4.0
    assert SuffixSettings().max_spec_tokens == 32


def test_a_draft_is_cut_to_what_its_own_evidence_pays_for() -> None:
    """``SuffixSettings.pass_costs`` (the factory's, from the target's measured pass cost): a continuation is cut to
    the prefix with the most expected tokens per unit of pass cost, and dropped where none beats the target alone.
    On llama.cpp's 2-core curve a sure long copy keeps all its tokens, a coin-flip continuation none."""
    from verispec.drafters.suffix import SuffixDraft

    costs = (1.0, 1.7, 2.2, 2.6, 2.9, 3.2, 3.5, 3.8, 4.5)  # a pass of 1 + n tokens over a one-token pass
    sure = SuffixDraft([1, 2, 3, 4, 5, 6, 7, 8], 8.0, 12, "request", [1.0] * 8)
    assert sure.worth(costs).token_ids == [1, 2, 3, 4, 5, 6, 7]  # the 8th token costs 0.7 for at most 1
    fading = SuffixDraft([1, 2, 3, 4], 2.2, 3, "request", [0.9, 0.7, 0.4, 0.2])
    assert fading.worth(costs).token_ids == [1, 2]  # (1 + 0.9 + 0.7) / 2.2 beats one token, and 3 or 4 tokens
    coin = SuffixDraft([1, 2], 0.75, 2, "request", [0.5, 0.25])
    assert coin.worth(costs) is None and coin.worth(()) is coin  # 1.5 / 1.7 < 1; no costs, no gate
    # In the drafter: arctic-inference estimates these copies' tokens at 0.5 each, so 3 tokens (2.5 expected for 2.6
    # passes) do not pay, 4 do just (3 for 2.9), and of 9 the first 7 pay best (4.5 for 3.8).
    drafter = SuffixDrafter(settings=SuffixSettings(pass_costs=costs, min_token_prob=0.0))
    text = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter.start([[9, *text, 0, *text, 0, *text[:4]], [9, *text, 0, *text[:4]], [7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3]],
                  GREEDY, 512)
    assert [d and d.token_ids for d in drafter.drafts()] == [[5, 6, 7, 8, 0, 1, 2], [5, 6, 7, 8], None]
