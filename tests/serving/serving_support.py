"""Helpers of the serving tests: a word-level tokenizer (one word = one token, so token counts can be read
off the text; only EOS is special: every other id decodes to exactly one word), tiny saved model pairs, a live
server on a free loopback port, and a Prometheus text parser."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

WORDS = ["<unk>", "<s>", "</s>"] + [
    "def", "return", "x", "y", "z", "(", ")", ":", "+", "-", "*", "1", "2", "3", "if", "else", "for", "in", "print",
    "hello", "world", "user", "assistant", "system", "the", "a", "cat", "dog",
]
EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def word_tokenizer(eos: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>" if eos else None)
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


def save_pair(root: Path, max_positions: int = 128, eos: bool = True) -> tuple[str, str]:
    """A tiny Llama target (its ``NAN_ID`` embedding row NaN) and a perturbed copy as draft, with the word
    tokenizer, saved under ``root``; returns their folders. ``eos=False``: no EOS anywhere, so every completion
    runs to its length."""
    import torch
    from tiny_models import perturbed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS) + PADDING, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=EOS if eos else None, initializer_range=0.1)
    target = LlamaForCausalLM(config).eval()
    draft = perturbed(target, scale=0.08, seed=3)
    with torch.no_grad():
        target.get_input_embeddings().weight[NAN_ID] = float("nan")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        word_tokenizer(eos).save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "the state waited for") -> None:
    """Poll ``condition``, a state that another thread or process changes, until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout} s")
        time.sleep(0.005)


def status(url: str) -> int | None:
    """The HTTP status of ``GET url``, or None while nothing answers there."""
    try:
        return httpx.get(url, timeout=1.0).status_code
    except httpx.HTTPError:
        return None


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    wait_until(lambda: status(f"{url}/health") == 200, timeout, f"the server at {url} healthy")


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
    ``options``: the app's ``ServerOptions``; one request's choices hold half the batch by default, as in
    ``verispec serve``."""
    import openai

    from verispec.factory import load
    from verispec.serving.app import create_app
    from verispec.serving.engine import Engine

    target, draft = model_dirs
    decoder, tokenizer = load(target, draft, fast=False, **decoder_options)
    engine = Engine(decoder, max_batch_size=max_batch_size,
                    max_rows_per_group=max_rows_per_group or max(1, max_batch_size // 2))
    engine.start()
    app = create_app(engine, tokenizer, MODEL, max_context=decoder.max_positions, eos_token_ids=[EOS],
                     options=options)
    server = LiveServer(app)
    server.engine, server.tokenizer, server.decoder, server.app = engine, tokenizer, decoder, app
    server.target_dir = target
    server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    return server


# --------------------------------------------------------------------------- reading and holding a server


def extra(obj, name: str):
    """A field the OpenAI types do not declare (``stop_reason``, ``verispec``), as the client kept it."""
    extra = getattr(obj, "model_extra", None) or {}
    return extra.get(name, getattr(obj, name, None))


def expected_tokens(text: str, finish_reason: str, stop_reason) -> int:
    """Word-level tokenizer: one token per word (a word cut by a stop string too); a trailing space comes with
    the next word's token; plus EOS when the model stopped by itself."""
    return len(text.split()) + text.endswith(" ") + (finish_reason == "stop" and stop_reason is None)


def idle(live, timeout: float = 15.0) -> dict:
    """Wait until every engine request the server submitted has finished and the engine's batch is empty;
    return the engine's metrics."""

    def quiet() -> bool:
        metrics = live.engine.metrics()
        return live.app.state.verispec.in_flight == 0 and metrics["running"] == 0 and metrics["waiting"] == 0

    wait_until(quiet, timeout, "no request in flight and an empty batch")
    return live.engine.metrics()


@dataclass
class _ReleasingHandle:
    handle: Any
    released: threading.Event

    def cancel(self) -> None:
        self.handle.cancel()
        self.released.set()


class CancelGate:
    """Holds the engine, once a request has delivered ``after_tokens`` tokens, until the server cancels it
    (or it finishes): the cancellation then always lands while the request is still running, however fast or
    slow the machine. Only requests for which ``gated(request)`` holds are watched.

    It wraps ``engine.submit`` (to see each request's events and its handle's ``cancel``); the engine thread
    waits in a hook on the target model's forward pass. ``delivered`` is set once a watched request has
    delivered its tokens: a client may hang up from then on.
    """

    def __init__(self, live, after_tokens: int = 1, gated: Callable[[Any], bool] = lambda request: True):
        self.live, self.after_tokens, self.gated = live, after_tokens, gated
        self.delivered = threading.Event()
        self._watched: list[tuple[threading.Event, threading.Event]] = []  # (delivered, released) per request
        self._lock = threading.Lock()

    def __enter__(self) -> CancelGate:
        submit = self.live.engine.submit

        def gated_submit(request, on_event: Callable) -> Any:
            if not self.gated(request):
                return submit(request, on_event)
            delivered, released = threading.Event(), threading.Event()
            count = 0

            def watch(event) -> None:
                nonlocal count
                if not hasattr(event, "tokens"):  # the FinishEvent
                    released.set()
                else:
                    count += len(event.tokens)
                    if count >= self.after_tokens:
                        delivered.set()
                        self.delivered.set()
                on_event(event)

            with self._lock:  # before submitting: the engine may run the request at once
                self._watched.append((delivered, released))
            return _ReleasingHandle(submit(request, watch), released)

        self.live.engine.submit = gated_submit
        self._hook = self.live.decoder.target_model.register_forward_pre_hook(self._hold)
        return self

    def _hold(self, module, args) -> None:
        with self._lock:
            watched = list(self._watched)
        for delivered, released in watched:
            if delivered.is_set():
                released.wait(timeout=60)

    def __exit__(self, *exc_info) -> None:
        del self.live.engine.submit
        self._hook.remove()
        with self._lock:
            for _, released in self._watched:
                released.set()


def post(live, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{live.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
