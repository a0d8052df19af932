"""Tiny random-weight causal LMs built from configs (no downloads), and drafts that agree with them partly."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from verispec.drafters import ModelDrafter, Proposal
from verispec.policy import CapDecision, SpeculationController, bucket_label, bucket_of

VOCAB = 512
KINDS = ("gpt2", "llama", "qwen2")


def build(kind: str, seed: int = 0, vocab_size: int = VOCAB, layers: int = 2) -> PreTrainedModel:
    """A tiny model of one of the three classes. Init scales chosen so greedy output is not degenerate."""
    torch.manual_seed(seed)  # model construction only; decoding never touches the global RNG
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=layers, n_head=4, n_positions=256,
                            initializer_range=0.1, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.eval()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread inside the block, restored after it: tiny matrices gain nothing from a second
    thread, and on a shared, loaded CPU the threads mostly wait on each other (tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spread(model: PreTrainedModel, seed: int = 0, gain: float = 2.0) -> PreTrainedModel:
    """``model`` with its matrices drawn again, N(0, gain^2 / fan_in), in eval mode: a random model whose greedy
    output varies with its input (the default initialisation's tiny encoder-decoders repeat one token)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator) * gain / param.shape[-1] ** 0.5)
    return model.eval()


def perturbed(model: PreTrainedModel, scale: float = 0.1, seed: int = 1) -> PreTrainedModel:
    """A copy of ``model`` with relative Gaussian noise on every weight: a draft that agrees partly."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.add_(noise * scale * param.std().clamp(min=1e-3))
    return draft.eval()


@functools.lru_cache(maxsize=None)
def pair(kind: str) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedModel]:
    """(target, partly agreeing draft, unrelated draft) for ``kind``; cached across tests."""
    target = build(kind, seed=0)
    return target, perturbed(target), build(kind, seed=123)


def save_word_model(folder, words: list[str], seed: int) -> str:
    """A tiny Llama saved with a word-level tokenizer over ``words`` (``<unk>``, ``<s>``, ``</s>`` first): a model
    folder the factory, the command line and the server load by path. Returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    torch.manual_seed(seed)  # model construction only
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def prompt(length: int, seed: int, vocab_size: int = VOCAB) -> list[int]:
    return torch.randint(1, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(model: PreTrainedModel, tokens: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation, from transformers' generate (no EOS stopping)."""
    out = model.generate(
        torch.tensor([tokens]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(tokens):].tolist()


class ConfidentDrafter(ModelDrafter):
    """A ModelDrafter with fixed per-row early-stop thresholds (row b gets ``thresholds[b % len]``), whatever
    the batch passes: to test the early-stop path on its own. Counts the blocks it cut short."""

    def __init__(self, model: PreTrainedModel, thresholds: list[float]) -> None:
        super().__init__(model)
        self.thresholds = thresholds
        self.short_blocks = 0

    def fork(self) -> ConfidentDrafter:
        return ConfidentDrafter(self.model, self.thresholds)

    def propose(self, num_draft_tokens: int, uniforms, stop_below=None) -> Proposal:
        own = [self.thresholds[b % len(self.thresholds)] for b in range(len(self.pending))]
        proposal = super().propose(num_draft_tokens, uniforms, own)
        if proposal.draft_lengths is not None:
            self.short_blocks += int((proposal.draft_lengths < num_draft_tokens).sum())
        return proposal


class AlwaysDraft(SpeculationController):
    """A controller that lets every row draft its full length (a tiny random draft rarely pays, and this test
    is about thresholds, not the cap), with step latencies that make each column cost half a step."""

    def __init__(self) -> None:
        super().__init__()
        for rows in (1, 2):
            for columns in range(13):
                self.observe_step(rows, columns, 1.0 + 0.5 * columns)

    def decide(self, rows, backlog=0):
        lengths = [r.limit for r in rows]
        size = len(rows)
        return lengths, CapDecision(max(lengths), "pays", size, bucket_label(bucket_of(size)), tokens=float(size))


def plain_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The plain loop's logits before each of ``tokens`` (one token a pass, on ``model``'s backend), ``[len(tokens),
    V]``: what a divergence from it is judged by."""
    from verispec.models.backend import backend_of

    with backend_of(model).new_cache() as cache:
        cache.reset(1)
        cache.prefill([prompt])
        out, context = [], [*prompt]
        for token in tokens:
            ids = torch.tensor([[context[-1]]])
            out.append(cache.forward(ids, torch.ones_like(ids, dtype=torch.bool),
                                     torch.tensor([[len(context) - 1]]))[0, -1])
            context.append(token)
        return torch.stack(out)


def plain_gap(model, prompt: list[int], tokens: list[int]) -> float:
    """The plain loop's top-2 logit gap before the last of ``tokens`` (a near-tie when small)."""
    top2 = plain_logits(model, prompt, tokens)[-1].topk(2).values
    return float(top2[0] - top2[1])
