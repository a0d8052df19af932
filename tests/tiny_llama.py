"""A tiny llama-architecture GGUF the llama.cpp tests write themselves (no downloads).

Its weights come from a tiny random ``LlamaForCausalLM`` (Q4_0 matrices, so weight repacking and its batch-size
regimes apply as on real files), with a 272-token byte-level BPE vocabulary. ``tiny_gguf`` is the fixture that
writes it once per session.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"), ("o", "n"),
          ("r", "e"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "r"), ("Ġ", "w"), ("e", "s")]
TOKENS = [*bytes_to_unicode().values(), *(a + b for a, b in MERGES), "<|endoftext|>"]
VOCAB = len(TOKENS)  # 272
EOS = VOCAB - 1


def tiny_hf_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny llama with peaked distributions (scaled embeddings and head), so greedy paths are not near-ties."""
    torch.manual_seed(seed)  # construction only
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
                linear.weight.mul_(5.0)
    return model


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotary layout (halves) to GGUF llama's (pairs), as llama.cpp's converter does."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def write_gguf(model: LlamaForCausalLM, path, context_length: int | None = None, small: bool = False) -> None:
    """``model`` as a llama-architecture GGUF: Q4_0 matrices, float32 embeddings (``small``: Q4_0 too, so the
    file is about half the size: a draft a load prices as cheaper than its target) and norms, this vocabulary;
    its context length is the model's ``max_position_embeddings`` unless ``context_length`` says otherwise."""
    import gguf  # the tests that write GGUFs skip without it (``pytest.importorskip``)

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("verispec-tiny")
    writer.add_context_length(context_length or config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(EOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(False)

    def add(name: str, tensor: torch.Tensor, quantise: bool = True, heads: int | None = None) -> None:
        data = tensor.detach().float().numpy()
        if heads is not None:
            data = _permute(data, heads)
        if quantise:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))

    add("token_embd.weight", model.model.embed_tokens.weight, quantise=small)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, quantise=False)
        add(f"blk.{i}.attn_q.weight", attn.q_proj.weight, heads=config.num_attention_heads)
        add(f"blk.{i}.attn_k.weight", attn.k_proj.weight, heads=config.num_key_value_heads)
        add(f"blk.{i}.attn_v.weight", attn.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, quantise=False)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    add("output_norm.weight", model.model.norm.weight, quantise=False)
    add("output.weight", model.lm_head.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple:
    """``(path of the GGUF, the float32 torch model it was written from)``, written once per session."""
    model = tiny_hf_model()
    path = tmp_path_factory.mktemp("llamacpp") / "tiny-llama.gguf"
    write_gguf(model, path)
    return path, model


def kept_cells_match_their_tokens(model) -> None:
    """A ``LlamaModel`` with no row running: no running row holds a cell, and each sequence the prompt cache keeps
    holds exactly its tokens' cells."""
    for seq, (_, held) in model._kept.items():
        assert model.context.used_cells([seq]) == len(held)
    assert model.held_cells() == 0 and not model._live
