"""``models.cache.host_threads``: the loop's host work around a model's pass runs on the torch threads the model
asks for (llama.cpp's ``LlamaModel``: one), and each thread's own setting comes back afterwards."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from verispec.models.cache import host_threads
from verispec.models.llamacpp import LlamaModel


def test_a_model_that_asks_for_nothing_leaves_torch_alone():
    before = torch.get_num_threads()
    with host_threads(SimpleNamespace()):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_the_setting_holds_inside_and_is_restored_after():
    torch.set_num_threads(2)
    with host_threads(SimpleNamespace(host_threads=1)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_two_threads_inside_at_once_each_see_one_and_get_their_own_back():
    """Two batches (an engine's thread and a ``generate`` caller) inside at once, leaving in either order:
    each works with one thread inside, and neither leaves the other's setting changed."""
    torch.set_num_threads(2)
    model = SimpleNamespace(host_threads=1)
    inside, leave_first, first_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        torch.set_num_threads(2)
        with host_threads(model):
            seen["first inside"] = torch.get_num_threads()
            inside.set()
            leave_first.wait(30)
        seen["first after"] = torch.get_num_threads()
        first_left.set()

    worker = threading.Thread(target=first)
    worker.start()
    assert inside.wait(30)
    with host_threads(model):
        leave_first.set()
        assert first_left.wait(30)
        seen["second inside"] = torch.get_num_threads()  # the first left: still one thread here
    worker.join(30)
    assert seen == {"first inside": 1, "first after": 2, "second inside": 1}
    assert torch.get_num_threads() == 2


def test_the_llama_cpp_model_asks_for_one_thread_and_the_loop_honours_it(monkeypatch):
    """A decode step on a llama.cpp target verifies with one torch thread (the class attribute the batch
    reads; the end-to-end path is covered by tests/models/test_llamacpp.py)."""
    assert LlamaModel.host_threads == 1
    from verispec.decode import batch as batch_module

    seen: list[int] = []
    original = batch_module.DecodeBatch._verify

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(batch_module.DecodeBatch, "_verify", spy)
    from transformers import LlamaConfig, LlamaForCausalLM

    from verispec import SpeculativeDecoder

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    torch.set_num_threads(2)
    from verispec.models.backend import TorchBackend

    monkeypatch.setattr(TorchBackend, "host_threads", 1)  # stands in for LlamaModel's: a model built in a second
    SpeculativeDecoder(model, None, vocab_size=64).generate([[1, 2, 3]], max_new_tokens=3)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
