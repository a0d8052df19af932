"""The llama.cpp backend (``verispec/models/llamacpp.py``) on a tiny GGUF the tests write themselves.

The GGUF is a 2-layer llama-architecture model whose weights come from a tiny random ``LlamaForCausalLM``
(Q4_0 matrices, so weight repacking and its batch-size regimes apply as on real files), with a 272-token
byte-level BPE vocabulary; the same ``LlamaForCausalLM`` in float32, slightly perturbed, is a torch draft that
agrees with it partly (so blocks are partly accepted: where rollback bugs show), and written as a GGUF of its own,
the same draft on llama.cpp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/llamacpp.md)")
pytest.importorskip("gguf")

import tiny_llama  # noqa: E402
from stats.chi_square import chi2_pvalue  # noqa: E402
from tiny_llama import VOCAB, tiny_hf_model, write_gguf  # noqa: E402
from tiny_models import perturbed  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from verispec import LoadError, SpeculativeDecoder  # noqa: E402
from verispec.core.sampling import SamplingParams, probs_from_logits  # noqa: E402
from verispec.drafters import ModelDrafter  # noqa: E402
from verispec.models.llama_context import probe_depths  # noqa: E402
from verispec.models.llamacpp import (  # noqa: E402
    LlamaCache,
    LlamaModel,
    LlamaSettings,
    greedy_reference,
    load_llama_draft,
)

tiny_gguf = tiny_llama.tiny_gguf  # the session fixture that writes the tiny GGUF


@pytest.fixture(scope="session", params=[(True, False), (True, True), (False, False)],
                ids=["streams", "streams-repack", "shared-memory"])
def llama(tiny_gguf, request) -> LlamaModel:
    """The backend with a KV stream per row (bitwise per row in any batch), with weight repacking on and off,
    and with one memory shared by all rows (bitwise for a single row; see ``LlamaSettings``)."""
    streams, repack = request.param
    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=1024 if streams else 4096, n_threads=1, repack=repack,
                                                   n_seq_max=80, streams=streams))
    yield model
    model.close()


def same_logits(llama: LlamaModel, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal with a stream per row; in a shared memory, equal up to the order flash attention visits a
    row's keys in (a row's new token may take a cell another row freed)."""
    return torch.equal(a, b) if llama.settings.per_row_streams() else torch.allclose(a, b, rtol=0, atol=0.05)


@pytest.fixture(scope="session")
def draft(tiny_gguf) -> LlamaForCausalLM:
    return perturbed(tiny_gguf[1], scale=0.15)


@pytest.fixture(scope="session")
def draft_gguf(draft, tmp_path_factory):
    """The torch draft written as a GGUF (Q4_0, its embeddings too: half the target's file, so a load prices
    its tokens at half a target pass): a draft model for llama.cpp."""
    path = tmp_path_factory.mktemp("llamacpp-draft") / "tiny-llama-draft.gguf"
    write_gguf(draft, path, small=True)
    return path


@pytest.fixture(scope="session")
def llama_draft(draft_gguf) -> LlamaModel:
    """The draft GGUF on llama.cpp as the factory runs one beside a target: a KV stream per row (the default),
    repacking on, passes uncut, no regime probe."""
    model = load_llama_draft(draft_gguf, LlamaSettings(bitwise=True, n_ctx=1024, n_threads=2, n_seq_max=80))
    yield model
    model.close()


@pytest.fixture(params=["torch", "llama.cpp"])
def any_draft(request, draft, llama_draft):
    """The partly agreeing draft, on torch and on llama.cpp."""
    return draft if request.param == "torch" else llama_draft


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------- regime probe


def test_regime_probe_finds_the_bitwise_invariant_pass_size(llama):
    regime = llama.regime
    assert 1 <= regime.cap <= 16
    assert all(d == 0.0 for d in regime.diffs[: regime.cap])
    if regime.cap < 16:  # the probe stopped at the first pass size that differs
        assert len(regime.diffs) == regime.cap + 1 and regime.diffs[-1] > 0.0
    # Check the claim independently: a block of `cap` tokens after a prompt equals one token at a time, after a
    # short prompt and after one past 256 tokens (where ggml's one-query flash attention splits the keys).
    for length in (20, 300):
        prompt, block = prompts([length, regime.cap], seed=5)
        steps = [prompt[-1], *block]
        cache = llama.new_cache()
        cache.reset(2)
        cache.prefill([prompt, prompt])
        together = cache.forward(torch.tensor([steps, steps]), torch.ones(2, len(steps), dtype=torch.bool),
                                 torch.arange(length - 1, length - 1 + len(steps)).expand(2, -1))  # passes <= cap
        assert torch.equal(together[0], decode_alone(llama, prompt, block)), length
        assert torch.equal(together[1], together[0]), length
        cache.select_rows([])


def test_more_than_one_thread_caps_passes_at_one_token(tiny_gguf):
    """With flash attention on 2 threads, a one-token pass past 255 cached tokens splits its keys across the
    threads, so a wider pass equals it only by chance (the tiny model: caps of 16, 3, 2, 9 and 7 tokens at 24, 255,
    256, 300 and 600 cached tokens): the regime allows one token per pass, and says why."""
    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=2, n_seq_max=2))
    try:
        assert model.regime.cap == 1
        assert "2 threads" in model.regime.reason and "split" in model.regime.reason
    finally:
        model.close()


def test_no_draft_is_made_where_each_drafted_token_costs_a_pass(tiny_gguf):
    """At a cap of one token per pass k drafts cost k + 1 passes, which commit at most k + 1 tokens: the planner
    prices every draft out ("auto" and a fixed length alike: reason "priced", no exploration, no calibration),
    which is llama.cpp's plain decoding."""
    from verispec.decode.calibrate import calibrate
    from verispec.drafters import NGramDrafter
    from verispec.policy import MOST_DRAFTS, paying_cap

    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=512, n_threads=2, n_seq_max=2))
    try:
        assert model.pass_cap == 1
        rows = [p * 3 for p in prompts([20, 30], seed=47)]  # repeated text: prompt lookup finds drafts
        auto = SpeculativeDecoder(model, drafter=NGramDrafter())
        assert not paying_cap(auto.pass_cost, 1, MOST_DRAFTS) and not calibrate(auto, rows[0]).step_seconds
        assert auto.pass_cost(4, 1) == 4 * auto.pass_cost(1, 1)
        out = auto.generate(rows, max_new_tokens=30)
        fixed = auto.generate(rows, max_new_tokens=30, num_draft_tokens=3)
        assert out.stats.draft_tokens == fixed.stats.draft_tokens == 0
        assert set(out.stats.controller_steps) == set(fixed.stats.controller_steps) == {"priced"}
        for b, prompt in enumerate(rows):
            assert out.tokens[b] == fixed.tokens[b] == greedy_reference(model, prompt, 30), b
    finally:
        model.close()


def test_a_draft_model_that_cannot_pay_is_not_loaded(tiny_gguf, draft_gguf):
    """Beside a target that verifies one token per pass a draft model would never draft (every schedule is priced
    out): the factory does not load it (no weights, no KV streams) and says why; suffix+MODEL keeps its suffix
    part, free drafters stay."""
    from verispec.drafters import SuffixDrafter
    from verispec.factory import load

    settings = LlamaSettings(bitwise=True, n_ctx=256, n_seq_max=2, n_threads=2)
    for draft, kind in ((str(draft_gguf), type(None)), (f"suffix+{draft_gguf}", SuffixDrafter)):
        said: list[str] = []
        decoder, _ = load(str(tiny_gguf[0]), draft, llama_settings=settings, progress=said.append)
        try:
            assert isinstance(decoder.drafter, kind), draft
            assert any("not loaded" in line and "k + 1 passes" in line for line in said), said
            assert not any("calibrat" in line for line in said), said
        finally:
            decoder.target_model.close()


def test_a_gguf_draft_as_dear_as_its_target_is_not_loaded(tiny_gguf, draft, tmp_path):
    """Priced before loading: a GGUF draft whose file is as large as the target's costs about a target pass a
    token, so even kept at the best acceptance measured no draft length pays (on one thread, where passes of
    several tokens are cheap and a half-size draft loads: ``test_factory_runs_a_gguf_draft...``). The load
    says why, and suffix decoding drafts instead (free drafts can pay there), as suffix+MODEL's suffix part."""
    from verispec.drafters import SuffixDrafter
    from verispec.factory import load

    dear = tmp_path / "dear-draft.gguf"
    write_gguf(draft, dear)
    settings = LlamaSettings(bitwise=True, n_ctx=256, n_seq_max=2, n_threads=1)
    for name in (str(dear), f"suffix+{dear}"):
        said: list[str] = []
        decoder, _ = load(str(tiny_gguf[0]), name, llama_settings=settings, progress=said.append, calibrate=False,
                          num_draft_tokens=3)
        try:
            assert isinstance(decoder.drafter, SuffixDrafter), name
            assert any("not loaded" in line and "no draft length beats the target alone" in line for line in said)
            assert any("suffix decoding drafts instead" in line for line in said) == ("+" not in name), said
        finally:
            decoder.target_model.close()


def test_the_auto_draft_is_suffix_decoding_on_llama_cpp_and_the_draft_model_on_torch(tiny_gguf, tmp_path):
    """``draft="auto"``, every command's default but the demo's: on llama.cpp a draft model costs more than it
    saves on a CPU, so suffix decoding drafts (free drafts); on torch, the zoo's draft model. Checked before
    loading like any name; the load says what it chose."""
    from verispec.cli import build_parser
    from verispec.drafters import SuffixDrafter
    from verispec.factory import AUTO_DRAFT_MODEL, auto_draft, check_load_options, load

    path = str(tiny_gguf[0])
    assert auto_draft(path) == "suffix" and auto_draft(path, "torch") == AUTO_DRAFT_MODEL
    folder = tmp_path / "hf"
    tiny_hf_model().save_pretrained(folder)
    assert auto_draft(str(folder)) == AUTO_DRAFT_MODEL
    check_load_options(path, "auto")
    check_load_options(str(folder), "auto", here=False)
    assert {build_parser().parse_args([name]).draft for name in ("generate", "serve")} == {"auto"}
    said: list[str] = []
    decoder, _ = load(path, "auto", calibrate=False, progress=said.append,
                      llama_settings=LlamaSettings(n_ctx=256, n_seq_max=2))
    try:
        assert isinstance(decoder.drafter, SuffixDrafter)
        assert any(line.startswith("draft: auto: suffix") for line in said), said
    finally:
        decoder.target_model.close()


def test_the_probe_looks_past_the_split_key_threshold():
    """ggml's flash attention splits a single query's keys across threads once the KV window reaches 512 cells
    (cached tokens past 255): a probe at short contexts only would miss it (it did: the 1.5B Q4_K_M passes of
    2-3 tokens equal one-token decoding at 24 cached tokens and differ by ~0.4 from 256 on, with 2 threads)."""
    from verispec.models.llamacpp import PROBE_DEPTHS

    assert min(PROBE_DEPTHS) < 256 <= max(PROBE_DEPTHS)


def decode_alone(llama: LlamaModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits ``[1 + len(tokens), V]`` of a row alone: its prompt, then the last prompt token and ``tokens``
    one per pass."""
    cache = llama.new_cache()
    cache.reset(1)
    cache.prefill([prompt])
    steps = [prompt[-1], *tokens]
    out = [cache.forward(torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([[len(prompt) - 1 + j]]))
           for j, t in enumerate(steps)]
    cache.select_rows([])
    return torch.cat(out, dim=1)[0]


def test_the_probe_measures_the_rows_own_layout_across_its_context(llama):
    """The probe runs in the model's own KV layout (a stream per row, or the shared memory) at depths spread across
    a row's context, up to its deepest block, and its reason names that layout; it gives its sequence back."""
    regime, positions = llama.regime, llama.max_positions
    spread = probe_depths(positions, 16)
    assert regime.depths == tuple(spread[: len(regime.depths)]) and len(regime.depths) >= 2
    if regime.cap > 1:  # the probe stops early only at a cap of one token
        assert regime.depths[-1] == positions - 16 and positions // 2 in regime.depths
    layout = "a KV stream of its own" if llama.settings.per_row_streams() else "shared by up to 80 rows"
    assert layout in regime.reason and f"{positions} positions" in regime.reason, regime.reason
    assert f"{regime.depths[-1]} cached tokens" in regime.reason
    assert len(llama._free_seqs) == 80 and llama.context.used_cells() == 0


def test_a_context_with_no_room_for_a_probe_gets_one_token_passes(tiny_gguf, tmp_path):
    """A GGUF whose context (16 tokens) cannot hold a probe block after a cached token: nothing is measured, so
    the probe fails closed (passes of one token, and the reason says why) instead of assuming its widest pass."""
    path = tmp_path / "short.gguf"
    write_gguf(tiny_gguf[1], path, context_length=16)
    with LlamaModel(path, LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, n_seq_max=2)) as model:
        assert model.max_positions == 16
        assert (model.regime.cap, model.pass_cap, model.regime.depths) == (1, 1, ())
        assert "nothing measured" in model.regime.reason and "16 positions" in model.regime.reason
        rows = prompts([5, 8], seed=48)
        out = SpeculativeDecoder(model, tiny_gguf[1], num_draft_tokens=3).generate(rows, max_new_tokens=6)
        assert out.tokens == [greedy_reference(model, p, 6) for p in rows]


def test_a_context_shorter_than_1024_tokens_is_measured(tiny_gguf, tmp_path):
    """A GGUF trained on 512 tokens: the probe measures across those 512 (it used to skip every depth there and
    call its widest pass probed); the cap it finds holds at its deepest block."""
    path = tmp_path / "ctx512.gguf"
    write_gguf(tiny_gguf[1], path, context_length=512)
    with LlamaModel(path, LlamaSettings(bitwise=True, n_ctx=1024, n_threads=1, n_seq_max=2)) as model:
        regime = model.regime
        assert model.max_positions == 512 and regime.depths[0] == 24 and "512 positions" in regime.reason
        if regime.cap > 1:
            assert regime.depths[-1] == 512 - 16
        prompt, block = prompts([500, regime.cap], seed=49)
        cache = model.new_cache()
        cache.reset(1)
        cache.prefill([prompt])
        steps = [prompt[-1], *block]
        together = cache.forward(torch.tensor([steps]), torch.ones(1, len(steps), dtype=torch.bool),
                                 torch.arange(499, 499 + len(steps))[None])  # passes of up to the cap
        assert torch.equal(together[0], decode_alone(model, prompt, block))
        cache.close()


def test_repacking_narrows_the_regime(tiny_gguf):
    """The probe sees what the research measured: repacking's multi-row kernel starts at fewer rows."""
    off = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, repack=False, n_seq_max=4))
    on = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, repack=True, n_seq_max=4))
    try:
        assert on.regime.cap <= off.regime.cap
    finally:
        off.close()
        on.close()


# ------------------------------------------------------------------------------------------ cache contract


def test_rollback_per_row_then_continue_is_bitwise_one_token_decoding(llama):
    """Two rows score a block of 5, keep 2 and 4 of them, then go on one token at a time: every logit equals the
    row alone decoding the kept tokens one at a time."""
    base = prompts([12, 7], seed=1)
    blocks = prompts([4, 4], seed=2)
    tails = prompts([4, 4], seed=3)
    kept = [2, 4]
    cache = llama.new_cache()
    cache.reset(2)
    cache.prefill(base)
    lengths = [len(p) for p in base]
    first = torch.tensor([[p[-1], *blk] for p, blk in zip(base, blocks)])  # [2, 5]
    positions = torch.tensor([[n - 1 + j for j in range(5)] for n in lengths])
    cache.forward(first, torch.ones_like(first, dtype=torch.bool), positions)
    cache.rollback([n - 1 + k for n, k in zip(lengths, kept)])  # the prompt but its last token, then k kept
    got = []
    for j in range(4):
        step = torch.tensor([[t[j]] for t in tails])
        pos = torch.tensor([[n - 1 + k + j] for n, k in zip(lengths, kept)])
        got.append(cache.forward(step, torch.ones_like(step, dtype=torch.bool), pos))
    got = torch.cat(got, dim=1)  # [2, 4, V]
    cache.close()
    for b in range(2):
        alone = decode_alone(llama, base[b], blocks[b][: kept[b] - 1] + tails[b])
        assert same_logits(llama, got[b], alone[kept[b]:]), b


def test_rollback_to_any_length_then_continue_is_bitwise_one_token_decoding(llama):
    """Rows rolled back to lengths of their own: one keeps its whole block, one goes back into its prompt, one to
    nothing, and one that has not scored yet (its prompt's last token pending) back into its prompt too; each then
    goes on as the row alone decoding the tokens it kept."""
    base = prompts([10, 12, 6, 9], seed=30)
    block = prompts([4, 4, 4, 4], seed=31)
    tails = prompts([3, 3, 3, 3], seed=32)
    cache = llama.new_cache()
    cache.reset(4)
    cache.prefill(base)
    first = torch.tensor([[p[-1], *blk] for p, blk in zip(base, block)])  # [4, 5]
    mask = torch.ones_like(first, dtype=torch.bool)
    mask[3] = False  # row 3 scores nothing yet: its prompt's last token stays pending
    cache.forward(first, mask, torch.zeros_like(first))
    histories = [p + blk for p, blk in zip(base, block)]
    lengths = [len(histories[0]) - 1, 5, 0, 4]  # row 0: all but the last; 1 and 3: into the prompt; 2: nothing
    with pytest.raises(ValueError, match=r"rows \[3\]"):  # never more positions than a row holds
        cache.rollback([lengths[0], 5, 0, len(base[3])])
    cache.rollback(lengths)
    assert [row.length for row in cache.rows] == lengths and cache.rows[3].opening is None
    got = []
    for j in range(3):
        step = torch.tensor([[t[j]] for t in tails])
        got.append(cache.forward(step, torch.ones_like(step, dtype=torch.bool), torch.zeros_like(step)))
    got = torch.cat(got, dim=1)  # [4, 3, V]
    for b, (history, n) in enumerate(zip([histories[0], histories[1], base[2], base[3]], lengths)):
        alone = decode_alone(llama, history[:n] + tails[b][:1], tails[b][1:])  # [3, V]
        assert same_logits(llama, got[b], alone), b
    cache.close()


def test_close_gives_every_sequence_back(llama, tiny_gguf):
    """``close`` (or leaving ``with``) frees a cache's sequences and their memory at once, whatever still refers
    to the cache; ``reset`` opens it again. A model closes the same way, twice harmlessly."""
    free, used = len(llama._free_seqs), llama.context.used_cells()
    with llama.new_cache() as cache:
        cache.reset(3)
        cache.prefill(prompts([7, 9, 4], seed=33))
        assert len(llama._free_seqs) == free - 3 and llama.context.used_cells() == used + 20
    assert cache.batch_size == 0 and len(llama._free_seqs) == free and llama.context.used_cells() == used
    cache.close()
    cache.reset(1)
    assert len(llama._free_seqs) == free - 1
    cache.close()
    assert len(llama._free_seqs) == free
    with LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, n_seq_max=2)) as model:
        assert model.context is not None
    assert model.context is None and model.model is None
    model.close()


def test_select_and_append_rows_keep_each_row_exact(llama):
    """A row dropped mid-batch frees its sequence; a fresh row prefilled in a cache of its own joins; every
    remaining row's logits stay those of the row alone."""
    free_before = len(llama._free_seqs)
    rows = prompts([9, 15, 6], seed=4)
    cache = llama.new_cache()
    cache.reset(3)
    cache.prefill(rows)
    step = torch.tensor([[p[-1]] for p in rows])
    cache.forward(step, torch.ones_like(step, dtype=torch.bool), torch.tensor([[len(p) - 1] for p in rows]))
    cache.select_rows([0, 2])
    assert len(llama._free_seqs) == free_before - 2
    joining = prompts([11], seed=6)[0]
    fresh = llama.new_cache()
    fresh.reset(1)
    fresh.prefill([joining])
    cache.append_rows(fresh)
    assert fresh.batch_size == 0 and cache.batch_size == 3
    nxt = torch.tensor([[3], [4], [joining[-1]]])
    out = cache.forward(nxt, torch.ones_like(nxt, dtype=torch.bool), torch.tensor([[9], [6], [10]]))
    assert same_logits(llama, out[0, 0], decode_alone(llama, rows[0], [3])[-1])
    assert same_logits(llama, out[1, 0], decode_alone(llama, rows[2], [4])[-1])
    assert same_logits(llama, out[2, 0], decode_alone(llama, joining, [])[-1])
    cache.select_rows([])
    assert len(llama._free_seqs) == free_before


def test_a_pass_is_cut_into_calls_by_tokens_and_by_outputs():
    """``_Context.calls``: at most ``capacity`` (or the bitwise cut) tokens and ``most_outputs`` asked logits per
    call, in order, every token in exactly one call; tokens whose logits are not asked (a prompt's) ride along."""
    from types import SimpleNamespace

    from verispec.models.llama_context import _Context

    context = SimpleNamespace(capacity=8, most_outputs=3)
    outputs = [False] * 5 + [True] * 7 + [False, True]
    for most_tokens in (None, 4, 1):
        calls = _Context.calls(context, outputs, most_tokens)
        assert [i for call in calls for i in range(len(outputs))[call]] == list(range(len(outputs)))
        assert all(0 < call.stop - call.start <= (most_tokens or 8) for call in calls)
        assert all(sum(outputs[call]) <= 3 for call in calls)
    assert _Context.calls(context, outputs) == [slice(0, 8), slice(8, 11), slice(11, 14)]
    assert _Context.calls(context, []) == []


def test_a_pass_asking_more_logits_than_the_context_reserved_is_cut_and_stays_exact(tiny_gguf, draft):
    """llama.cpp aborts the process on a call asking for more outputs than ``n_outputs_max``: a context reserved
    for 4 (``LlamaSettings.outputs``) verifies blocks of 2 rows x 9 tokens in calls of at most 4 logits rows,
    and the output is still llama.cpp's plain greedy loop's."""
    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=512, n_threads=1, n_seq_max=2, streams=True,
                                                   outputs=4))
    asked: list[int] = []
    decode = model.context.decode

    def counting(tokens, positions, seqs, outputs, copy=True):
        asked.append(sum(map(bool, outputs)))
        return decode(tokens, positions, seqs, outputs, copy)

    try:
        assert model.context.most_outputs == 4
        model.context.decode = counting
        rows = prompts([7, 11], seed=31)
        out = SpeculativeDecoder(model, draft, num_draft_tokens=8).generate(rows, max_new_tokens=24)
        assert out.tokens == [greedy_reference(model, p, 24) for p in rows]
        assert max(asked) == 4 and out.stats.draft_tokens > 0
    finally:
        model.close()


def test_num_logits_and_rollback_over_several_forwards(llama):
    """As a draft uses a cache: ``num_logits=1`` returns the last column's logits only (what a full pass gives
    there), and a rollback reaches over several one-token forwards; each row then continues as if alone."""
    base = prompts([9, 13], seed=20)
    fed = prompts([3, 3], seed=21)
    cache = llama.new_cache()
    cache.reset(2)
    ids = torch.tensor([[0] * 4 + base[0], base[1]])  # left-padded, as the drafter feeds its prompts
    mask = ids.new_ones(ids.shape, dtype=torch.bool)
    mask[0, :4] = False
    last = cache.forward(ids, mask, torch.zeros_like(ids), num_logits=1)  # [2, 1, V]
    assert last.shape == (2, 1, VOCAB)
    for b in range(2):
        assert same_logits(llama, last[b, 0], decode_alone(llama, base[b][:-1], [base[b][-1]])[-1])
    for j in range(3):  # three one-token forwards, then keep 1 and 3 of those columns
        step = torch.tensor([[f[j]] for f in fed])
        cache.forward(step, torch.ones_like(step, dtype=torch.bool), torch.zeros_like(step), num_logits=1)
    cache.rollback([len(base[0]) + 1, len(base[1]) + 3])  # keep 1 and 3 of those columns
    assert [row.length for row in cache.rows] == [len(base[0]) + 1, len(base[1]) + 3]
    nxt = torch.tensor([[5], [6]])
    out = cache.forward(nxt, torch.ones_like(nxt, dtype=torch.bool), torch.zeros_like(nxt))
    assert same_logits(llama, out[0, 0], decode_alone(llama, base[0], fed[0][:1] + [5])[-1])
    assert same_logits(llama, out[1, 0], decode_alone(llama, base[1], fed[1] + [6])[-1])
    cache.select_rows([])


# --------------------------------------------------------------------------------- decoding through the loop


def test_greedy_equals_llama_cpp_plain_loop_mixed_lengths(llama, any_draft):
    """Speculative greedy with a partly agreeing draft on torch or on llama.cpp (fixed 4 drafts, budget 37: not a
    multiple), rows of different prompt lengths in one batch, equals llama.cpp's plain greedy loop per row; blocks
    are partly accepted (where rollback errors show)."""
    rows = prompts([5, 17, 40, 1], seed=7)
    decoder = SpeculativeDecoder(llama, any_draft, num_draft_tokens=4)
    out = decoder.generate(rows, max_new_tokens=37)
    for b, prompt in enumerate(rows):
        assert out.tokens[b] == greedy_reference(llama, prompt, 37), b
    stats = out.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    alone = decoder.generate(rows, max_new_tokens=37, draft=None)
    assert alone.tokens == out.tokens


def test_eos_inside_an_accepted_block_ends_the_row(llama, any_draft):
    prompt, other = prompts([14, 6], seed=8)
    reference = greedy_reference(llama, prompt, 30)
    eos = reference[9]  # a token the row emits mid-way: generation must stop right after its first occurrence
    first = reference.index(eos)
    decoder = SpeculativeDecoder(llama, any_draft, num_draft_tokens=4)
    out = decoder.generate([prompt, other], max_new_tokens=30, eos_token_id=eos)
    assert out.tokens[0] == reference[: first + 1] and out.finish_reasons[0] == "stop"
    assert out.tokens[1] == greedy_reference(llama, other, 30, [eos])
    assert out.stats.row_accepted_tokens[0] > 0  # the row kept drafts: blocks, with the EOS inside one or not


def test_sampling_law_of_two_tokens_is_the_targets(llama, draft):
    """Speculative sampling (temperature 0.8, top-k 4) with a draft that disagrees partly: the joint law of the
    first two tokens matches llama.cpp's logits through verispec's warpers (chi-square, p > 1e-6)."""
    check_two_token_law(llama, draft)


@pytest.mark.parametrize("llama", [(False, False)], indirect=True, ids=["shared-memory"])
def test_sampling_law_with_a_llama_cpp_draft(llama, llama_draft):
    """The same law with the draft on llama.cpp too (its probabilities from its own logits, passes uncut)."""
    check_two_token_law(llama, llama_draft)


def check_two_token_law(llama: LlamaModel, draft) -> None:
    prompt = prompts([10], seed=10)[0]
    params = SamplingParams(temperature=0.8, top_k=4)
    context_model = llama
    from verispec.models.llamacpp import _Context

    with context_model.lock:
        context = _Context(context_model, 64, 1)
        try:
            first_logits = torch.from_numpy(context.prompt_logits(prompt, 0))
            first = probs_from_logits(first_logits, params)  # [V]
            law = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
            for token in torch.nonzero(first).flatten().tolist():
                context.remove(0, len(prompt), -1)
                second = probs_from_logits(torch.from_numpy(context.decode([token], [len(prompt)], [0], [True])[0]),
                                           params)
                law[token] = first[token].double() * second.double()
        finally:
            context.close()
    decoder = SpeculativeDecoder(llama, draft, num_draft_tokens=3)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for call in range(40):
        out = decoder.generate([prompt] * 64, max_new_tokens=2, temperature=0.8, top_k=4, seed=call)
        for tokens in out.tokens:
            counts[tokens[0], tokens[1]] += 1
    support = law > 0
    assert counts[~support].sum() == 0
    assert chi2_pvalue(counts[support].numpy(), law[support].numpy()) > 1e-6


def test_prompt_longer_than_the_context_is_a_value_error(tiny_gguf):
    small = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=64, n_threads=2, n_seq_max=2))
    try:
        decoder = SpeculativeDecoder(small)
        with pytest.raises(ValueError, match="llama.cpp context holds 64 tokens"):
            decoder.generate([prompts([60], seed=11)[0]], max_new_tokens=10)
    finally:
        small.close()


def test_too_many_rows_is_a_clear_error(tiny_gguf):
    small = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=2, n_seq_max=2))
    try:
        cache = LlamaCache(small)
        with pytest.raises(RuntimeError, match="at most 2 rows"):
            cache.reset(3)
    finally:
        small.close()


def test_model_drafter_unchanged_on_llama_target(llama, draft):
    """A torch ModelDrafter drafts for the llama.cpp target through the same interface."""
    decoder = SpeculativeDecoder(llama, drafter=ModelDrafter(draft), num_draft_tokens=2)
    prompt = prompts([8], seed=12)[0]
    assert decoder.generate([prompt], max_new_tokens=12).tokens[0] == greedy_reference(llama, prompt, 12)


def test_load_error_for_non_gguf_with_llama_backend(tmp_path):
    from verispec.factory import load

    folder = tmp_path / "hf"
    tiny_hf_model().save_pretrained(folder)
    with pytest.raises(LoadError, match="GGUF"):
        load(str(folder), backend="llama.cpp")


def test_auto_backend_picks_llama_cpp_for_a_gguf(tiny_gguf):
    from verispec.factory import choose_backend, load
    from verispec.models.llamacpp import LlamaSettings as Settings

    path = str(tiny_gguf[0])
    assert choose_backend(path) == "llama.cpp" and choose_backend(path, "torch") == "torch"
    decoder, tokenizer = load(path, "ngram", calibrate=False, llama_settings=Settings(n_ctx=256, n_seq_max=4))
    try:
        assert isinstance(decoder.target_model, LlamaModel) and len(tokenizer) == VOCAB
        # trees are off unless asked for: no spare branch ids (llama.cpp reserves a row of logits for each)
        assert decoder.target_model.settings.branch_seqs() == 0 and decoder.target_model.tree_branches <= 1
        ids = tokenizer("the cat sat on the mat, the cat sat on the")["input_ids"]
        assert decoder.generate([ids], max_new_tokens=12).tokens[0] == greedy_reference(decoder.target_model, ids, 12)
    finally:
        decoder.target_model.close()
    decoder, _ = load(path, "ngram", calibrate=False, llama_settings=Settings(n_ctx=256, n_seq_max=4), trees=True)
    try:
        assert decoder.target_model.settings.branch_seqs() > 0
    finally:
        decoder.target_model.close()


def test_factory_runs_a_gguf_draft_on_llama_cpp_beside_the_target(tiny_gguf, draft_gguf, draft, tmp_path):
    """A GGUF draft (with the target's tokenizer) beside a llama.cpp target runs on llama.cpp with llama.cpp's
    fast defaults, also as suffix+MODEL's model; the progress says where; greedy output is the plain loop's. A
    draft that is no GGUF, or a torch target, keeps the draft on torch."""
    from verispec.drafters import CompositeDrafter
    from verispec.factory import load

    # One thread: passes of several tokens are bitwise there, so a draft can pay (on two, none is even loaded).
    settings = LlamaSettings(bitwise=True, n_ctx=256, n_seq_max=4, n_threads=1)
    said: list[str] = []
    decoder, tokenizer = load(str(tiny_gguf[0]), str(draft_gguf), calibrate=False, llama_settings=settings,
                              progress=said.append, num_draft_tokens=3)
    target, draft_model = decoder.target_model, decoder.drafter.model
    try:
        assert isinstance(target, LlamaModel) and isinstance(draft_model, LlamaModel)
        assert draft_model.settings.repack and not draft_model.settings.bitwise and draft_model.regime is None
        assert (draft_model.settings.n_ctx, draft_model.settings.n_seq_max) == (256, 4)
        assert any("on llama.cpp beside the target" in line for line in said), said
        assert not any("on torch" in line for line in said), said
        ids = tokenizer("the cat sat on the mat, the cat sat on the")["input_ids"]
        out = decoder.generate([ids], max_new_tokens=16)
        assert out.tokens[0] == greedy_reference(target, ids, 16) and out.stats.draft_tokens > 0
    finally:
        target.close()
        draft_model.close()

    decoder, _ = load(str(tiny_gguf[0]), f"suffix+{draft_gguf}", calibrate=False, llama_settings=settings,
                      num_draft_tokens=3)
    try:
        assert isinstance(decoder.drafter, CompositeDrafter)
        assert isinstance(decoder.drafter.model.model, LlamaModel)
    finally:
        decoder.target_model.close()
        decoder.drafter.model.model.close()

    folder = tmp_path / "hf-draft"
    draft.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    said.clear()
    decoder, _ = load(str(tiny_gguf[0]), str(folder), calibrate=False, llama_settings=settings, progress=said.append,
                      num_draft_tokens=3)
    try:
        assert isinstance(decoder.drafter.model, torch.nn.Module)
        assert any("on torch" in line for line in said), said
    finally:
        decoder.target_model.close()
    decoder, _ = load(str(tiny_gguf[0]), str(draft_gguf), backend="torch", calibrate=False)
    assert isinstance(decoder.target_model, torch.nn.Module) and isinstance(decoder.drafter.model, torch.nn.Module)


def test_missing_binding_is_a_one_line_load_error(tiny_gguf, monkeypatch):
    import verispec.models.llamacpp as backend
    from verispec.factory import choose_backend, load

    monkeypatch.setattr(backend, "llama_cpp_unavailable", lambda: backend.LLAMA_CPP_MISSING)
    assert choose_backend(str(tiny_gguf[0])) == "torch"  # auto falls back
    with pytest.raises(LoadError, match="llama-cpp-python is not installed") as error:
        load(str(tiny_gguf[0]), backend="llama.cpp")
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "suffix"])
def test_real_target_greedy_equals_llama_cpp_plain_decoding(draft):
    """The zoo's Qwen2.5-Coder-1.5B GGUF on llama.cpp with a free draft: greedy output equals llama.cpp's plain
    greedy loop on the same file and settings, for a prompt that copies its input, asked twice (suffix decoding
    drafts the second answer from the first: a rename leaves little of the prompt to copy token for token)."""
    from verispec import eos_token_ids
    from verispec.factory import load

    decoder, tokenizer = load("qwen2.5-coder-1.5b", draft, backend="llama.cpp", calibrate=False)
    model = decoder.target_model
    try:
        text = ("Rename `total` to `acc` and output the code:\n```python\ndef add_all(values):\n    total = 0\n"
                "    for v in values:\n        total += v\n    return total\n```\n")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
        eos = eos_token_ids(tokenizer, model)
        reference = greedy_reference(model, ids, 48, eos)
        accepted = 0
        for _ in range(2):
            out = decoder.generate([ids], max_new_tokens=48, eos_token_id=eos, num_draft_tokens=4)
            assert out.tokens[0] == reference
            accepted += out.stats.accepted_tokens
        assert accepted > 0
    finally:
        model.close()


@pytest.mark.slow
def test_real_pair_both_on_llama_cpp_greedy_equals_the_targets_plain_decoding():
    """Qwen2.5-Coder-1.5B with the 0.5B as a draft model, both GGUFs on llama.cpp (the draft beside the target,
    llama.cpp's fast defaults): greedy output of a batch of 2 prompts equals llama.cpp's plain greedy loop of the
    target per prompt (a KV stream per row: bitwise per row in a batch), or parts from it only at a near-tie of
    the plain loop (the default mode's passes are whole: its logits move by up to 0.71 here,
    ``benchmarks/llamacpp/results/identity.md``). Built by hand, not by ``load``: whether ``load`` runs this
    draft at all is priced from this machine's pass costs (``test_a_gguf_draft_as_dear_as_its_target...``)."""
    from tiny_models import plain_logits

    from verispec import eos_token_ids
    from verispec.acquire import resolve
    from verispec.models.loading import load_tokenizer

    files = resolve("qwen2.5-coder-1.5b", backend="llama.cpp")
    tokenizer = load_tokenizer(files)
    target = LlamaModel(files.path, LlamaSettings(n_ctx=512, n_seq_max=2, streams=True))
    draft_model = load_llama_draft(resolve("qwen2.5-coder-0.5b", backend="llama.cpp").path, target.settings)
    decoder = SpeculativeDecoder(target, draft_model, num_draft_tokens=4)
    try:
        texts = ["Write a Python function that returns the n-th Fibonacci number.",
                 "Explain in one sentence what a hash map is."]
        rows = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False)["input_ids"]
                for t in texts]
        eos = eos_token_ids(tokenizer, target)
        out = decoder.generate(rows, max_new_tokens=32, eos_token_id=eos, num_draft_tokens=4)
        for b, ids in enumerate(rows):
            expected = greedy_reference(target, ids, 32, eos)
            first = next((i for i, (a, c) in enumerate(zip(expected, out.tokens[b])) if a != c), None)
            if first is None:
                assert out.tokens[b] == expected, b
            else:  # a near-tie of the plain loop: its top-2 gap within twice the kernels' largest difference
                top2 = plain_logits(target, ids, expected[:first + 1])[-1].topk(2).values
                assert float(top2[0] - top2[1]) <= 2 * 0.71, (b, first, float(top2[0] - top2[1]))
        assert out.stats.accepted_tokens > 0
    finally:
        target.close()
        draft_model.close()


def test_passes_cut_to_a_small_cap_stay_exact(tiny_gguf, draft):
    """With a cap of 3 tokens per call (as repacking gives real Q4_K files), a step of 3 rows x 5 tokens is cut
    into 5 calls, rows split across calls: output still llama.cpp's plain greedy loop's."""
    import dataclasses

    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=512, n_threads=2, n_seq_max=8, streams=True))
    try:
        model.regime = dataclasses.replace(model.regime, cap=3)
        model._pass_cost = None  # measured again, for passes cut at the cap set here
        rows = prompts([6, 13, 3], seed=13)
        out = SpeculativeDecoder(model, draft, num_draft_tokens=4).generate(rows, max_new_tokens=21)
        assert out.tokens == [greedy_reference(model, p, 21) for p in rows]
        assert 0 < out.stats.accepted_tokens < out.stats.draft_tokens
    finally:
        model.close()


def test_engine_rows_joining_mid_run_keep_llama_cpp_greedy_output(llama, any_draft):
    """The server's engine on the llama.cpp backend, the draft on torch or on llama.cpp: requests join a running
    batch (their prompts evaluated in caches of their own, appended; a llama.cpp draft prefills them at its next
    proposal), leave when done (sequences freed, the draft's too); each output is the plain loop's."""
    import threading

    from verispec.serving.engine import Engine, EngineRequest, TokensEvent

    class Collector:
        def __init__(self) -> None:
            self.tokens: list[int] = []
            self.finish = None
            self.started, self.done = threading.Event(), threading.Event()

        def __call__(self, event) -> None:
            if isinstance(event, TokensEvent):
                self.tokens.extend(event.tokens)
                self.started.set()
            else:
                self.finish = event
                self.done.set()

    free_before = len(llama._free_seqs)
    draft_free = len(any_draft._free_seqs) if isinstance(any_draft, LlamaModel) else None
    engine = Engine(SpeculativeDecoder(llama, any_draft, num_draft_tokens=3), max_batch_size=3)
    engine.start()
    try:
        requests = [EngineRequest(p, max_new_tokens=20 + 4 * i) for i, p in enumerate(prompts([5, 12, 8, 3, 16], 14))]
        collectors = [Collector() for _ in requests]
        engine.submit(requests[0], collectors[0])
        assert collectors[0].started.wait(60)  # running: the others join mid-run
        for request, collector in zip(requests[1:], collectors[1:]):
            engine.submit(request, collector)
        for request, collector in zip(requests, collectors):
            assert collector.done.wait(120) and collector.finish.reason == "length"
            assert collector.tokens == greedy_reference(llama, request.prompt_ids, request.max_new_tokens)
    finally:
        engine.shutdown()
    assert len(llama._free_seqs) == free_before  # every finished row gave its sequence back
    if draft_free is not None:
        assert len(any_draft._free_seqs) == draft_free


# ------------------------------------------------------------------------------------------- a full KV memory


def test_a_pass_that_finds_no_cells_leaves_the_cache_as_it_was(tiny_gguf):
    """llama.cpp keeps what earlier calls of a pass (and of a long prompt) stored when a later call finds no KV
    cells; the cache removes it again: a ``CacheFullError`` naming n_ctx, the rows and the memory as before, and
    the same pass once there is room scores as each row alone (up to the order of its cells)."""
    from verispec.models.cache import CacheFullError

    small = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=2, n_seq_max=4, n_batch=8, streams=False))
    try:
        filler = small.new_cache()
        filler.reset(1)
        filler.prefill(prompts([240], seed=40))  # 240 of the 256 cells
        base = prompts([4, 4], seed=41)
        cache = small.new_cache()
        cache.reset(2)
        cache.prefill(base)  # 8 more: 8 cells left, and the two openings already stored
        used = small.context.used_cells()
        assert used == 248 and cache.room().tokens == 10 and "n_ctx=256" in cache.room().memory

        late = small.new_cache()
        late.reset(1)
        with pytest.raises(CacheFullError, match="n_ctx=256"):
            late.prefill(prompts([20], seed=42))  # a first call of 8 tokens fits, the second does not
        assert (late.rows[0].length, late.rows[0].opening) == (0, None) and small.context.used_cells() == used
        late.select_rows([])

        more = prompts([7, 7], seed=43)
        block = torch.tensor([[p[-1], *m] for p, m in zip(base, more)])  # [2, 8]: 14 new tokens in calls of 8
        with pytest.raises(CacheFullError, match="n_ctx=256"):
            cache.forward(block, torch.ones_like(block, dtype=torch.bool), torch.zeros_like(block))
        assert [(row.length, row.opening is not None) for row in cache.rows] == [(3, True), (3, True)]
        assert small.context.used_cells() == used and cache.room().tokens == 10

        filler.select_rows([])  # the rows' new tokens take cells before their older ones: logits within 0.05
        out = cache.forward(block, torch.ones_like(block, dtype=torch.bool), torch.zeros_like(block))
        for b in range(2):
            assert torch.allclose(out[b], decode_alone(small, base[b], more[b]), rtol=0, atol=0.05)
        cache.select_rows([])
        assert small.context.used_cells() == 0
    finally:
        small.close()


@pytest.fixture(params=["torch-draft", "llama.cpp-draft"])
def small_pair(request, tiny_gguf, draft, draft_gguf):
    """A target whose shared memory holds 256 tokens (n_ctx=256), and the partly agreeing draft: on torch, or on
    llama.cpp with the memory the factory gives it (the target's layout)."""
    # One thread: passes of several tokens are bitwise there, so the drafts this test needs can pay.
    target = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, n_seq_max=8, streams=False))
    on_llama = request.param == "llama.cpp-draft"
    draft_model = load_llama_draft(draft_gguf, target.settings) if on_llama else draft
    yield target, draft_model
    target.close()
    if on_llama:
        draft_model.close()


def test_rows_a_shared_memory_cannot_hold_together_wait_and_all_finish(small_pair):
    """Four rows that each fit the 256 cells alone but not together: ``generate`` admits them by need (prompt,
    budget and longest draft), the later ones wait for cells, and every row runs to its end with llama.cpp's plain
    greedy output, its memory freed after. Before issue 41 the newest two ended with an error (memory full)."""
    target, draft_model = small_pair
    rows = prompts([30, 25, 40, 35], seed=44)
    decoder = SpeculativeDecoder(target, draft_model, num_draft_tokens=4, bitwise=True)
    out = decoder.generate(rows, max_new_tokens=80)
    assert out.finish_reasons == ["length"] * 4
    assert out.tokens == [greedy_reference(target, prompt, 80) for prompt in rows]
    assert out.stats.accepted_tokens > 0
    assert target.context.used_cells() == 0 and len(target._free_seqs) == 8


def test_prompts_the_memory_cannot_take_together_wait(small_pair):
    """Three prompts of 100 tokens in 256 cells: two run, the third waits for their cells and then runs."""
    target, draft_model = small_pair
    rows = prompts([100, 100, 100], seed=45)
    decoder = SpeculativeDecoder(target, draft_model, num_draft_tokens=3, bitwise=True)
    out = decoder.generate(rows, max_new_tokens=20)
    assert out.finish_reasons == ["length"] * 3
    assert out.tokens == [greedy_reference(target, p, 20) for p in rows]


class EngineResults:
    """What an engine's requests ended with, by key: ``(tokens, finish reason, error)``; ``done`` is set once
    ``expected`` requests have ended."""

    def __init__(self, expected: int) -> None:
        import threading

        self.expected, self.finished, self.done = expected, {}, threading.Event()

    def collector(self, key: int):
        """The ``on_event`` callback of request ``key``."""
        from verispec.serving.engine import TokensEvent

        tokens: list[int] = []

        def on_event(event) -> None:
            if isinstance(event, TokensEvent):
                tokens.extend(event.tokens)
            else:
                self.finished[key] = (tokens, event.reason, event.error)
                if len(self.finished) == self.expected:
                    self.done.set()
        return on_event


def test_the_engine_queues_requests_a_shared_memory_cannot_hold_at_once(small_pair):
    """Through the server's engine: more concurrent requests than the shared memory holds at once all finish
    (queued until their cells are free, none with finish reason "error"), each with the plain loop's output, and
    the engine goes on serving. Before issue 41 two of them ended with "KV memory full"."""
    from verispec.serving.engine import Engine, EngineRequest

    target, draft_model = small_pair
    engine = Engine(SpeculativeDecoder(target, draft_model, num_draft_tokens=4, bitwise=True), max_batch_size=4)
    engine.start()
    try:
        rows = prompts([30, 25, 40, 35], seed=44)
        results = EngineResults(4)
        for key, prompt in enumerate(rows):
            engine.submit(EngineRequest(prompt, max_new_tokens=80), results.collector(key))
        assert results.done.wait(300)
        for key in range(4):
            assert results.finished[key] == (greedy_reference(target, rows[key], 80), "length", None), key
        again = EngineResults(1)
        engine.submit(EngineRequest(rows[3], max_new_tokens=80), again.collector(0))
        assert again.done.wait(120) and again.finished[0] == (greedy_reference(target, rows[3], 80), "length", None)
    finally:
        engine.shutdown()


def test_the_engine_batch_is_cut_to_the_rows_llama_cpp_holds(tiny_gguf, draft_gguf) -> None:
    """A context holds ``n_seq_max`` rows (a KV stream each): a server asked for a larger batch runs at most that
    many rows at once and queues the rest, each request with llama.cpp's plain greedy output (two threads: the
    streams keep every batched row bitwise), instead of failing to find a sequence for the third."""
    from verispec.serving.engine import Engine, EngineRequest

    target = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=512, n_threads=2, n_seq_max=2))
    draft_model = load_llama_draft(draft_gguf, target.settings)
    rows = prompts([30, 25, 40, 35, 20], seed=45)
    results = EngineResults(len(rows))
    engine = Engine(SpeculativeDecoder(target, draft_model, num_draft_tokens=4), max_batch_size=32)
    try:
        assert engine.max_batch_size == target.max_rows == 2
        engine.start()
        for key, prompt in enumerate(rows):
            engine.submit(EngineRequest(prompt, max_new_tokens=40), results.collector(key))
        assert results.done.wait(300)
        for key, prompt in enumerate(rows):
            assert results.finished[key] == (greedy_reference(target, prompt, 40), "length", None), key
    finally:
        engine.shutdown()
        target.close()
        draft_model.close()


def test_filler_past_a_rows_last_cell_takes_no_cell(tiny_gguf) -> None:
    """A row near the end of its stream scores a block as wide as another row's drafts: the columns past its last
    cell are filler (its own drafts stay within its budget), so they get zero logits and no cell instead of a full
    stream; the columns within it score as the row alone, and a rollback of the block keeps the row's length right."""
    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=256, n_threads=1, n_seq_max=2))
    try:
        prompt, more = prompts([254, 4], seed=51)
        cache = model.new_cache()
        cache.reset(1)
        cache.prefill([prompt])
        block = torch.tensor([[prompt[-1], *more]])  # positions 253..257 of a 256-cell stream
        out = cache.forward(block, torch.ones_like(block, dtype=torch.bool), torch.zeros_like(block))  # [1, 5, V]
        assert torch.equal(out[0, :3], decode_alone(model, prompt, more[:2]))
        assert not out[0, 3:].any() and cache.rows[0].length == 256
        cache.rollback([255])  # keep the last token and one draft: two cells of the block stay
        assert cache.rows[0].length == 255 and model.context.used_cells() == 255
        cache.select_rows([])
    finally:
        model.close()


def test_a_batch_job_on_a_gguf_target_holds_a_stream_for_each_row_of_a_group(tiny_gguf, tmp_path) -> None:
    """``run_batch`` on a llama.cpp target sizes the context by its groups (12 rows here, more than the library's
    default 8): every row is written with llama.cpp's plain greedy output, none fails for want of a sequence."""
    import json

    from verispec.offline import run_batch

    rows = prompts([12, 9, 15, 7, 11, 14, 8, 10, 13, 6, 9, 12], seed=46)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": row, "max_tokens": 24}) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    summary = run_batch(str(tiny_gguf[0]), "ngram", input_path=source, output_path=out, batch_size=12,
                        progress=False, backend="llama.cpp")
    assert (summary.written, summary.errors) == (12, 0)
    written = {row["input_index"]: row for row in map(json.loads, out.read_text().splitlines())}
    reference = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_seq_max=1))
    try:
        for index, prompt in enumerate(rows):
            assert written[index]["tokens"] == greedy_reference(reference, prompt, 24, reference.eos_ids), index
    finally:
        reference.close()


def test_a_batch_job_schedules_with_the_controller_on_llama_cpp_unless_bitwise(tiny_gguf, tmp_path) -> None:
    """``batch_schedule``: the timing-free heuristic where passes are bitwise whatever their shape (torch, the
    bitwise mode: a rerun decodes the same blocks, the same tokens), the priced controller on llama.cpp in the
    default mode (the heuristic's drafts made 8-row groups of real prompts ~25% slower than the target alone)."""
    from verispec.offline.job import batch_schedule

    path = str(tiny_gguf[0])
    assert batch_schedule(path, {}) == "auto"
    assert batch_schedule(path, {"bitwise": True}) == "heuristic"
    assert batch_schedule(path, {"llama_settings": LlamaSettings(bitwise=True)}) == "heuristic"
    assert batch_schedule(path, {"backend": "torch"}) == "heuristic"
    folder = tmp_path / "hf"
    tiny_hf_model().save_pretrained(folder)
    assert batch_schedule(str(folder), {}) == "heuristic"


def test_the_default_kv_memory_is_shared_and_the_bitwise_mode_has_a_stream_per_row() -> None:
    """By default (exact in distribution) one KV memory is shared by all rows, as llama-server's slots share
    theirs: 8192 cells for several rows, 4096 for one. In the bitwise mode every row has a KV stream of its own
    (bitwise in any batch) of 4096 tokens, unless that many rows would hold more than 65536 cells: the budget is
    then shared out in multiples of 256 (at least 256). A given ``n_ctx`` is each stream's, or the shared memory's."""
    default = LlamaSettings()
    assert not default.bitwise and not default.per_row_streams() and default.n_seq_max == 8
    assert (default.row_ctx(), default.kv_cells()) == (8192, 8192)
    assert LlamaSettings(n_seq_max=1).kv_cells() == 4096
    assert LlamaSettings(bitwise=True).per_row_streams()
    assert [LlamaSettings(bitwise=True, n_seq_max=n).row_ctx() for n in (1, 8, 16, 32, 48, 64, 300)] == [
        4096, 4096, 4096, 2048, 1280, 1024, 256]
    assert LlamaSettings(bitwise=True, n_seq_max=32).kv_cells() == 65536
    given = LlamaSettings(bitwise=True, n_ctx=1000, n_seq_max=4)
    assert (given.kv_cells(), given.row_ctx()) == (4000, 1000)
    shared = LlamaSettings(bitwise=True, n_seq_max=64, streams=False)
    assert (shared.row_ctx(), shared.kv_cells()) == (8192, 8192)
    assert LlamaSettings(n_ctx=1000, streams=True).kv_cells() == 8000


def test_the_llama_cpp_path_never_imports_transformers_modeling(tiny_gguf) -> None:
    """Decoding on llama.cpp with a free draft, in a fresh process that imported the CLI, the factory and the
    server, never imports transformers' modeling module (~120 MB of resident memory, what kept `verispec generate`
    above 1.2x llama.cpp's own peak RSS: benchmarks/llamacpp/memory.py)."""
    import subprocess
    import sys

    script = """
import sys
import verispec, verispec.cli, verispec.factory, verispec.serving.app
from verispec.drafters import NGramDrafter, SuffixDrafter
from verispec.models.llamacpp import LlamaModel, LlamaSettings
model = LlamaModel(sys.argv[1], LlamaSettings(bitwise=True, n_ctx=2048, n_threads=1, n_seq_max=1))
decoder = verispec.SpeculativeDecoder(model, None, vocab_size=model.vocab_size)
for drafter in (NGramDrafter(), SuffixDrafter(), None):
    out = decoder.generate([[1, 2, 3, 1, 2, 3, 1, 2]], max_new_tokens=6, draft=drafter)
    assert len(out.tokens[0]) == 6, out.tokens
print("transformers.modeling_utils" in sys.modules)  # PreTrainedModel's module
"""
    result = subprocess.run([sys.executable, "-c", script, str(tiny_gguf[0])], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("streams", [True, False], ids=["streams", "shared-memory"])
def test_on_two_threads_only_streams_keep_a_batched_row_bitwise(tiny_gguf, streams) -> None:
    """On more than one thread ggml's single-query flash attention splits the keys of the KV window across the
    threads; in one memory shared by all rows the window spans every row's cells, so a row decoded beside 15 others
    sums its keys in other parts than alone (found serving 16 clients: `benchmarks/serve_llamacpp_16/`). A KV
    stream per row keeps each row's window its own: bitwise. The shared memory is checked to be the one that
    differs, so the documented reason for ``--llama-streams`` stays true."""
    model = LlamaModel(tiny_gguf[0], LlamaSettings(bitwise=True, n_ctx=2048 if streams else 4096, n_threads=2, n_seq_max=16,
                                                   streams=streams))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, size=int(rng.integers(100, 160))).tolist() for _ in range(16)]

    def row_zero_logits(rows: list[int]) -> torch.Tensor:
        cache = model.new_cache()
        cache.reset(len(rows))
        cache.prefill([prompts[r] for r in rows])
        last, pos, seen = [prompts[r][-1] for r in rows], [len(prompts[r]) - 1 for r in rows], []
        for _ in range(30):
            out = cache.forward(torch.tensor([[t] for t in last]), torch.ones(len(rows), 1, dtype=torch.bool),
                                torch.tensor([[p] for p in pos]))  # [B, 1, V]
            seen.append(out[0, 0].clone())
            last, pos = out[:, 0].argmax(-1).tolist(), [p + 1 for p in pos]
        cache.select_rows([])
        return torch.stack(seen)  # [30, V]

    try:
        alone, batched = row_zero_logits([0]), row_zero_logits(list(range(16)))
    finally:
        model.close()
    assert torch.equal(alone, batched) == streams


def test_every_kernel_call_runs_on_one_thread() -> None:
    """ggml's OpenMP team belongs to the thread that calls in, and two teams on two cores make every barrier sleep
    (``_KernelThread``): calls from the main thread and from another (a server's engine) run on the same thread, and
    a call made on it runs at once instead of waiting for itself."""
    import threading

    from verispec.models.llama_context import _KernelThread

    seen: list[int] = []

    def where() -> int:
        seen.append(threading.get_ident())
        return _KernelThread.run(threading.get_ident)  # nested: runs inline

    results = [_KernelThread.run(where)]
    other = threading.Thread(target=lambda: results.append(_KernelThread.run(where)))
    other.start()
    other.join()
    assert len(set(seen)) == 1 and results == seen and seen[0] not in (threading.get_ident(), other.ident)

    # A forked child has no such thread (only the forking one survives a fork): it starts its own instead of waiting
    # forever on its parent's.
    import os
    import signal
    import time

    child = os.fork()
    if child == 0:
        os._exit(0 if _KernelThread.run(lambda: 7) == 7 else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the child's state with a deadline, not a fixed wait
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0
