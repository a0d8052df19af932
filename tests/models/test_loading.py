"""Resolving by path and Hub id (verispec.acquire), loading from the files (verispec.models.loading), the
factory ``verispec.load`` (verispec.factory) and EOS ids (verispec.models.eos), on tiny random-weight models saved
in the test: no downloads, and the Hub is only ever a cache folder the test fills, with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import reference_greedy
from torch import nn

import verispec
from verispec import zoo
from verispec.acquire import ModelFiles, ZooError, is_hub_id, resolve
from verispec.models import LoadError, chat_end_token_id, eos_token_ids, load_model
from verispec.models.fast import Int4Linear, PackedLinear

WORDS = ["<unk>", "<s>", "</s>", "def", "return", "x", "(", ")", ":", "+", "1", "hello", "world"]
CODE_WORDS = [*WORDS, "y", "if", "else", "for", "in", "print", "-", "2", "3", "while"]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}")


def tiny_tokenizer(words: list[str], specials: tuple[str, ...] = (), eos: str = "</s>", chat_template: str | None = None):
    """A word-level tokenizer over ``words`` plus ``specials`` added as special tokens (as real chat tokenizers
    add their turn markers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token=eos,
                                        additional_special_tokens=list(specials))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny(folder: Path, words: list[str], seed: int = 0, hidden: int = 16) -> Path:
    """A tiny Llama and its tokenizer saved as a Hugging Face model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_tokenizer(words).save_pretrained(folder)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), WORDS)


@pytest.fixture(scope="module")
def code_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Target and draft (the same weights, as a separate folder) with hidden size 64, so the int4 draft path
    runs; and a model with another vocabulary."""
    root = tmp_path_factory.mktemp("code-models")
    target = save_tiny(root / "target", CODE_WORDS, seed=0, hidden=64)
    shutil.copytree(target, root / "draft")
    save_tiny(root / "other", CODE_WORDS[:-2] + ["foo", "bar"], seed=1, hidden=64)
    return {name: str(root / name) for name in ("target", "draft", "other")}


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache under tmp_path, offline, as a user sets it with HF_HOME / HF_HUB_CACHE /
    HF_HUB_OFFLINE=1. huggingface_hub reads those variables once, when it is imported (before this test), so
    the values it read are set as well."""
    from huggingface_hub import constants

    home, hub = tmp_path / "hf-home", tmp_path / "hf-home" / "hub"
    hub.mkdir(parents=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def put_in_hub_cache(hub: Path, repo_id: str, source: Path) -> Path:
    """Lay out ``source``'s files as huggingface_hub caches a downloaded repo: refs/main names a snapshot."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(source, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo


def linear_types(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}


# ------------------------------------------------------------ model folders


def test_load_tiny_hf_dir(tiny_hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    path = str(tiny_hf_dir)
    assert resolve(path) == ModelFiles(path, "transformers", tiny_hf_dir, tiny_hf_dir, tiny_hf_dir, "folder")
    msgs: list[str] = []
    model, tok = load_model(path, dtype="bf16", progress=msgs.append)
    assert model.dtype == torch.bfloat16
    assert not model.training
    ids = tok("def x ( ) : return x + 1", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [[3, 5, 6, 7, 8, 4, 5, 9, 10]]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=2)
    assert out.shape[1] <= ids.shape[1] + 3 and out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert msgs == [f"loading tokenizer from {tiny_hf_dir}", f"loading weights from {tiny_hf_dir} (bfloat16) ..."]
    assert not any(tmp_path.iterdir())  # an HF folder needs no cache


def test_load_tiny_hf_dir_without_tokenizer(tiny_hf_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_hf_dir.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, bare / f.name)
    with pytest.raises(LoadError, match=f"cannot load model .*no usable tokenizer in {bare}"):
        load_model(str(bare))


def test_llama_cpp_takes_gguf_files_only(tiny_hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ZooError, match="runs GGUF models only"):
        resolve(str(tiny_hf_dir), backend="llama.cpp", cache=tmp_path)
    with pytest.raises(ValueError, match="backend must be"):
        resolve(str(tiny_hf_dir), backend="vllm", cache=tmp_path)  # type: ignore[arg-type]


# ----------------------------------------------------------------- Hub ids


def test_hub_id_loads_from_the_hf_cache_offline(tiny_hf_dir: Path, offline_hub: Path, tmp_path: Path) -> None:
    put_in_hub_cache(offline_hub, "tiny-org/tiny-llama", tiny_hf_dir)
    msgs: list[str] = []
    model, tokenizer = load_model("tiny-org/tiny-llama", progress=msgs.append)
    local, _ = load_model(str(tiny_hf_dir))
    assert model.dtype == torch.float32 and not model.training
    assert torch.equal(model.get_input_embeddings().weight, local.get_input_embeddings().weight)
    assert tokenizer.get_vocab() == {w: i for i, w in enumerate(WORDS)}
    assert any("tiny-org/tiny-llama" in m and "Hub" in m for m in msgs)
    # the same id through the factory and through resolve: a Hub id, not only local names
    decoder, _ = verispec.load("tiny-org/tiny-llama", "ngram")
    assert decoder.vocab_size == len(WORDS)
    files = resolve("tiny-org/tiny-llama", cache=tmp_path / "verispec")
    assert files.source == "hub" and files.kind == "transformers" and files.path.is_relative_to(offline_hub)
    assert (files.path / "model.safetensors").is_file() and not (tmp_path / "verispec").exists()


def test_missing_hub_id_offline_names_the_id(offline_hub: Path) -> None:
    with pytest.raises(LoadError) as error:
        verispec.load("tiny-org/no-such-model")
    message = str(error.value)
    assert "'tiny-org/no-such-model'" in message and "Hub id" in message
    assert "HF_HUB_OFFLINE" in message and str(offline_hub) in message
    assert "\n" not in message


def test_local_folder_wins_over_a_hub_id_of_the_same_shape(tiny_hf_dir: Path, offline_hub: Path,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(tiny_hf_dir, tmp_path / "work" / "tiny-org" / "tiny-llama")
    monkeypatch.chdir(tmp_path / "work")
    model, _ = load_model("tiny-org/tiny-llama")  # the Hub cache is empty: only the folder can answer
    assert model.config.vocab_size == len(WORDS)


def test_a_hub_id_fetches_what_transformers_reads_and_no_second_copy() -> None:
    """The files ``resolve`` asks the Hub for, as huggingface_hub filters a repository's listing: configs,
    tokenizer files and the safetensors ``save_pretrained`` names, not a repository's other copies of the weights
    (Mistral's consolidated.safetensors, fp16 variants, PyTorch pickles beside safetensors, ONNX)."""
    from huggingface_hub.utils import filter_repo_objects

    from verispec.acquire.sources import HUB_FILES, HUB_PICKLES

    wanted = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
              "vocab.json", "tokenizer.model", "chat_template.jinja", "model.safetensors.index.json",
              "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    others = ["consolidated.safetensors", "model.fp16.safetensors", "pytorch_model.bin", "onnx/model.onnx",
              "README.md", ".gitattributes", "original/consolidated.00.pth"]
    assert sorted(filter_repo_objects(wanted + others, allow_patterns=HUB_FILES)) == sorted(wanted)
    assert list(filter_repo_objects(["pytorch_model-00001-of-00002.bin", "flax_model.msgpack"],
                                    allow_patterns=HUB_PICKLES)) == ["pytorch_model-00001-of-00002.bin"]


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-Coder-7B-Instruct", "tiny-org/tiny-llama", "a/b"])
def test_hub_ids_are_recognised(name: str) -> None:
    assert is_hub_id(name)


@pytest.mark.parametrize("name", ["gpt2", "./a/b", "/a/b", "a/b/c", "~/a", "a/b.gguf", "a/..b", "own er/x"])
def test_other_names_are_not_hub_ids(name: str) -> None:
    assert not is_hub_id(name)


# ----------------------------------------------------------------- factory


def test_load_applies_the_cpu_fast_paths_and_stays_exact(code_models: dict[str, str]) -> None:
    msgs: list[str] = []
    decoder, tokenizer = verispec.load(code_models["target"], code_models["draft"], num_draft_tokens=3,
                                       progress=msgs.append)
    bits = 4 if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else 8
    assert any(f"int{bits} weights" in m for m in msgs) and any("target: linear layers pre-packed" in m for m in msgs)
    if torch.backends.mkldnn.is_available():
        assert linear_types(decoder.target_model) == {"PackedLinear"}
    if bits == 4:
        assert {type(m) for m in decoder.drafter.model.modules() if "Linear" in type(m).__name__} == {Int4Linear}
    assert decoder.vocab_size == len(tokenizer) == len(CODE_WORDS)

    plain, _ = load_model(code_models["target"])
    ids = tokenizer("def x ( y ) : return x + y")["input_ids"]
    out = decoder.generate([ids], max_new_tokens=16)
    assert out.tokens[0] == reference_greedy(plain, ids, 16)
    # The int4 copy keeps some drafts and loses others (tiny random models have many near-ties): the output
    # above is the target's own through both kinds of step.
    assert 0 < out.stats.acceptance_rate < 1


def test_load_without_fast_paths_and_other_drafts(code_models: dict[str, str]) -> None:
    decoder, tokenizer = verispec.load(code_models["target"], code_models["draft"], fast=False, num_draft_tokens=2)
    assert PackedLinear not in {type(m) for m in decoder.target_model.modules()}
    assert linear_types(decoder.drafter.model) == {"Linear"}
    ids = tokenizer("x + 1 x + 1 x +")["input_ids"]
    reference = decoder.generate([ids], max_new_tokens=8, draft=None).tokens[0]
    assert decoder.generate([ids], max_new_tokens=8).tokens[0] == reference
    for draft in ("ngram", "none", None):
        decoder, _ = verispec.load(code_models["target"], draft, fast=False)
        assert decoder.generate([ids], max_new_tokens=8).tokens[0] == reference
        assert (decoder.drafter is None) == (draft != "ngram")


def test_load_passes_decoder_options_and_dtype(code_models: dict[str, str]) -> None:
    decoder, tokenizer = verispec.load(code_models["target"], dtype="bfloat16", fast=False, num_draft_tokens=5,
                                       stop_drafting=False, vocab_size=len(CODE_WORDS) - 1)
    assert decoder.target_model.dtype == torch.bfloat16
    assert decoder.num_draft_tokens == 5 and decoder.stop_drafting is False
    assert decoder.vocab_size == len(tokenizer) - 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": "float13"}, LoadError, "unsupported dtype"),
        ({"device": "warp-drive"}, LoadError, "unknown device"),
        ({"draft_quant": "int2"}, ValueError, "draft_quant"),
        ({"cross_tokenizer": "bytes"}, ValueError, "cross_tokenizer"),
        ({"num_draft_tokens": -1}, ValueError, "num_draft_tokens"),
        ({"num_draft_tokens": "many"}, ValueError, "num_draft_tokens"),
        ({"temprature": 0.5}, TypeError, "temprature"),
        ({"drafter": None}, TypeError, "draft="),
    ],
)
def test_bad_options_fail_before_loading_anything(code_models: dict[str, str], kwargs: dict, error: type,
                                                  message: str) -> None:
    msgs: list[str] = []
    with pytest.raises(error, match=message):
        verispec.load(code_models["target"], code_models["draft"], progress=msgs.append, **kwargs)
    assert msgs == []


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Refuse tokenizers that map text differently (``load`` pairs such a draft through text instead): the
    message names how many tokens differ."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(t for t in target_vocab.keys() | draft_vocab.keys() if target_vocab.get(t) != draft_vocab.get(t))
    raise LoadError(
        f"target and draft tokenizers differ ({len(target_tokenizer)} vs {len(draft_tokenizer)} tokens, "
        f"{len(differing)} map differently, e.g. {differing[:3]}); pick a draft from the same model family"
    )


def test_unknown_name_is_a_load_error_and_another_tokenizer_drafts_through_text(code_models: dict[str, str]) -> None:
    from verispec.drafters import CrossTokenizerDrafter, IntersectionDrafter

    with pytest.raises(LoadError) as error:
        verispec.load("no-such-model")
    assert isinstance(error.value, ValueError)
    assert "'no-such-model'" in str(error.value)
    for name in zoo.ZOO:
        assert name in str(error.value)
    decoder, tokenizer = verispec.load(code_models["target"], code_models["other"], num_draft_tokens=3)
    assert isinstance(decoder.drafter, CrossTokenizerDrafter)
    ids = tokenizer("def x ( y ) : return x + y")["input_ids"]
    assert decoder.generate([ids], max_new_tokens=8).tokens == decoder.generate([ids], max_new_tokens=8, draft=None).tokens
    with pytest.raises(LoadError, match=r"tokenizers differ .*4 map differently.*same model family"):
        check_same_tokenizer(tokenizer, decoder.drafter.draft_tokenizer)
    with pytest.raises(LoadError, match="does not exist"):
        verispec.load(code_models["target"], "/no/such/draft")
    decoder, _ = verispec.load(code_models["target"], code_models["other"], num_draft_tokens=3,
                               cross_tokenizer="intersection")
    assert type(decoder.drafter) is IntersectionDrafter and len(decoder.drafter.shared[0]) > 0
    assert decoder.generate([ids], max_new_tokens=8).tokens == decoder.generate([ids], max_new_tokens=8, draft=None).tokens


# -------------------------------------------------------------------- EOS


def test_eos_ids_of_a_plain_tokenizer_and_the_generation_config() -> None:
    from transformers import GenerationConfig

    tokenizer = tiny_tokenizer(WORDS)
    assert chat_end_token_id(tokenizer) is None
    assert eos_token_ids(tokenizer) == [2]
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=[2, 5, 999]))  # 999: no such token
    assert eos_token_ids(tokenizer, model) == [2, 5]
    assert eos_token_ids(tokenizer, SimpleNamespace(generation_config=GenerationConfig(eos_token_id=7))) == [2, 7]
    assert eos_token_ids(tokenizer, SimpleNamespace(generation_config=GenerationConfig())) == [2]


def test_eos_ids_of_a_chat_tokenizer_derive_the_end_of_turn_token() -> None:
    chatml = tiny_tokenizer(WORDS, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), eos="<|endoftext|>",
                            chat_template=CHATML)
    im_end, endoftext = chatml.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert chat_end_token_id(chatml) == im_end
    assert eos_token_ids(chatml) == sorted([im_end, endoftext])

    # Llama 3's markers are in no list: the end of turn is read off the template
    specials = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>")
    llama3 = tiny_tokenizer(WORDS, specials, eos="<|end_of_text|>", chat_template=LLAMA3)
    eot, end_of_text = llama3.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert chat_end_token_id(llama3) == eot
    assert eos_token_ids(llama3) == sorted([eot, end_of_text])


def test_eos_ids_ignore_templates_without_a_special_end_and_plain_words() -> None:
    plain_end = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n\n{% endfor %}"
    refusing = "{{ raise_exception('this template only takes system messages') }}"
    for template in (plain_end, refusing):
        tokenizer = tiny_tokenizer(WORDS + ["<|endoftext|>"], chat_template=template)
        assert chat_end_token_id(tokenizer) is None
        # "<|endoftext|>" here is an ordinary word of the vocabulary, not a special token: it never stops
        assert eos_token_ids(tokenizer) == [2]


def test_a_draft_model_proposes_siblings_where_the_target_scores_wide_trees_cheaply() -> None:
    """``model_siblings``: a chain node's sibling a depth (``ModelDrafter(siblings=2)``) where the target scores trees
    and a 9-token pass costs under 1.5 one-token passes (as on a GPU), a chain where each token costs a share of a
    pass (llama.cpp on a CPU, measured) or the target scores chains only."""
    from types import SimpleNamespace

    from verispec.factory import model_siblings
    from verispec.models.pass_cost import PassCostCurve

    llama_cpu = PassCostCurve((1, 2, 4, 8, 16, 32), (0.028, 0.045, 0.070, 0.122, 0.135, 0.161))
    gpu = PassCostCurve((1, 2, 4, 8, 16, 32), (0.010, 0.010, 0.010, 0.011, 0.012, 0.014))
    assert model_siblings(SimpleNamespace(tree_branches=64, pass_cost=gpu)) == 2
    assert model_siblings(SimpleNamespace(tree_branches=5, pass_cost=llama_cpu)) == 1
    assert model_siblings(SimpleNamespace(tree_branches=1, pass_cost=gpu)) == 1


def test_load_gives_a_draft_model_siblings_where_they_pay(code_models: dict[str, str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``model_siblings`` says so, ``load`` drafts with ``ModelDrafter(draft, siblings=2)``: trees drafted, the
    target's own greedy output."""
    import verispec.factory
    from verispec.drafters import ModelDrafter

    monkeypatch.setattr(verispec.factory, "model_siblings", lambda backend: 2)
    msgs: list[str] = []
    decoder, tokenizer = verispec.load(code_models["target"], code_models["draft"], fast=False, num_draft_tokens=4,
                                       calibrate=False, progress=msgs.append, trees=True)
    assert isinstance(decoder.drafter, ModelDrafter) and decoder.drafter.siblings == 2
    chains, _ = verispec.load(code_models["target"], code_models["draft"], fast=False, calibrate=False)
    assert chains.drafter.siblings == 1  # trees are opt-in
    assert any("a tree of its chain" in m for m in msgs)
    ids = tokenizer("x + 1 x + 1 x +")["input_ids"]
    out = decoder.generate([ids], max_new_tokens=12)
    assert out.tokens[0] == decoder.generate([ids], max_new_tokens=12, draft=None).tokens[0]
    assert out.stats.tree_drafts > 0


def test_memory_freed_while_loading_goes_back_to_the_system() -> None:
    """``load`` ends with ``_give_back_freed_memory``: glibc keeps freed heap for reuse (here 200 MB of small
    blocks, freed under one still live, stay resident), and the call returns it (``malloc_trim``)."""
    import gc

    from verispec.factory import _give_back_freed_memory

    def resident_mb() -> int:
        return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("RssAnon"))

    blocks = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]  # ~200 MB from malloc, not Python's arenas
    live = bytes(1000) + b"x"  # allocated after them: the heap's top stays in use
    del blocks
    gc.collect()
    before = resident_mb()
    _give_back_freed_memory()
    assert resident_mb() < before - 100, (before, resident_mb())
    assert live
