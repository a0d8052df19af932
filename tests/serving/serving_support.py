"""Helpers of the serving tests: a word-level tokenizer (one word = one token, so token counts can be read
off the text; only EOS is special: every other id decodes to exactly one word), tiny saved model pairs, a live
server on a free loopback port, and a Prometheus text parser."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx

WORDS = ["<unk>", "<s>", "</s>"] + ["def", "return", "x", "y", "z", "(", ")", ":", "+", "-", "*", "1", "2", "3", "if", "else", "for", "in", "print", "hello", "world", "user", "assistant", "system", "the", "a", "cat", "dog"]
EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{label="value",...}': value}``, labels sorted by name (their order in the
    text carries no meaning), with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# ------------------------------------------------------------------------------------------ live servers

PADDING = 4  # embedding rows beyond the tokenizer (never proposed nor emitted)
NAN_ID = len(WORDS) + PADDING - 1  # its embedding is NaN in the target
MODEL = "tiny"


def save_pair(root: Path, max_positions: int = 128) -> tuple[str, str]:
    """A tiny Llama target (its ``NAN_ID`` embedding row NaN) and a perturbed copy as draft, with the word
    tokenizer, saved under ``root``; returns their folders."""
    import torch
    from tiny_models import perturbed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS) + PADDING, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=EOS, initializer_range=0.1)
    target = LlamaForCausalLM(config).eval()
    draft = perturbed(target, scale=0.08, seed=3)
    with torch.no_grad():
        target.get_input_embeddings().weight[NAN_ID] = float("nan")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server at {url} not healthy after {timeout} s")
        time.sleep(0.05)


class LiveServer:
    """uvicorn serving ``app`` in a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so (proto 0 leaves Nagle on, and a
        # response's two writes then wait 40 ms for a delayed ACK)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_tiny(model_dirs: tuple[str, str], *, options=None, max_batch_size: int = 16,
               max_rows_per_group: int | None = None, **decoder_options) -> LiveServer:
    """The app over an engine over the tiny pair (``decoder_options``: ``SpeculativeDecoder``'s), served;
    ``options``: the app's ``ServerOptions``."""
    import openai

    from verispec.models import load
    from verispec.serving.app import create_app
    from verispec.serving.engine import Engine

    target, draft = model_dirs
    decoder, tokenizer = load(target, draft, fast=False, **decoder_options)
    engine = Engine(decoder, max_batch_size=max_batch_size, max_rows_per_group=max_rows_per_group)
    engine.start()
    app = create_app(engine, tokenizer, MODEL, max_context=decoder.max_positions, eos_token_ids=[EOS],
                     options=options)
    server = LiveServer(app)
    server.engine, server.tokenizer, server.decoder, server.app = engine, tokenizer, decoder, app
    server.target_dir = target
    server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    return server
