"""``response_format`` (json_object, json_schema, and the regex / lark extensions) through the official
``openai`` client, streamed and not, on a tiny model pair with a character-level tokenizer."""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch
from grammar_support import JSON_CHARS, char_tokenizer
from serving_support import CHAT_TEMPLATE, MODEL, serve_tiny
from tiny_models import perturbed
from transformers import LlamaConfig, LlamaForCausalLM

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def structured(tmp_path_factory):
    root = tmp_path_factory.mktemp("char-models")
    tokenizer = char_tokenizer(JSON_CHARS, specials=("<unk>", "<s>", "</s>"))  # EOS = 2, as serve_tiny expects
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    target = LlamaForCausalLM(config).eval()
    for name, model in (("target", target), ("draft", perturbed(target, scale=0.08, seed=3))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    server = serve_tiny((str(root / "target"), str(root / "draft")), num_draft_tokens=3)
    yield server
    server.close()
    server.engine.shutdown()


FORMATS = [
    ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
     lambda text: set(json.loads(text)) == {"ok", "n"} and json.loads(text)["n"] in (1, 2, 3)),
    ({"type": "regex", "regex": "[a-f]{2,4}-[0-9]{2}"}, lambda text: re.fullmatch("[a-f]{2,4}-[0-9]{2}", text)),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("response_format, valid", FORMATS)
def test_completions_follow_the_format(structured, response_format, valid, stream) -> None:
    kwargs = {"model": MODEL, "prompt": "ab", "max_tokens": 120, "temperature": 1.0, "seed": 1, "n": 3,
              "extra_body": {"response_format": response_format}}
    texts, reasons = ["", "", ""], [None, None, None]
    if stream:
        for chunk in structured.client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        response = structured.client.completions.create(**kwargs)
        texts, reasons = [c.text for c in response.choices], [c.finish_reason for c in response.choices]
    finished = [text for text, reason in zip(texts, reasons) if reason == "stop"]
    assert finished and all(valid(text) for text in finished), (texts, reasons)  # a cut one cannot be whole


def test_chat_json_schema(structured) -> None:
    response = structured.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "give json"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert set(json.loads(response.choices[0].message.content)) == {"ok", "n"}


@pytest.mark.parametrize("response_format", [{"type": "regex"}, {"type": "regex", "regex": "a("},
                                             {"type": "json_schema"}, {"type": "xml"}])
def test_bad_formats_are_refused(structured, response_format) -> None:
    with pytest.raises(openai.BadRequestError):
        structured.client.completions.create(model=MODEL, prompt="ab", max_tokens=4,
                                             extra_body={"response_format": response_format})
