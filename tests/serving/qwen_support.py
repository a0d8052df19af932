"""A tiny model pair with a Qwen2.5-style tokenizer: byte-level BPE (so tokens can hold part of a UTF-8
character), Qwen's special tokens, and a chat template in Qwen2.5's form (Hermes-style tool calls in
``<tool_call>`` tags, tool results in ``<tool_response>`` tags)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "def merge(left, right):\n    return sorted(left + right)\n",
    "The quick brown fox jumps over the lazy dog. Ça coûte 5 € à Zürich; straße, smørrebrød.",
    "Привет, мир! Γειά σου κόσμε. 中文字 😀 🦀 λ-calculus and Ж.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>",
] * 3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>"]  # Qwen2.5: added tokens, not special (their text is in the output)
END = "<|im_end|>"

# Qwen2.5's chat template, in the form its tokenizer_config.json carries (the default system prompt shortened).
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def qwen_style_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=END, pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_qwen_style_pair(root: Path) -> tuple[str, str]:
    """A tiny Qwen2 target and a perturbed copy as draft, with the tokenizer above; returns their folders."""
    import torch
    from tiny_models import perturbed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = qwen_style_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         eos_token_id=tokenizer.convert_tokens_to_ids(END), initializer_range=0.1)
    target = Qwen2ForCausalLM(config).eval()
    draft = perturbed(target, scale=0.08, seed=3)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def serve_qwen_style(model_dirs: tuple[str, str], **decoder_options):
    """The app over the pair above (end tokens: ``<|im_end|>`` and ``<|endoftext|>``), served on loopback."""
    import openai
    from serving_support import LiveServer

    from verispec.factory import load
    from verispec.serving.app import create_app
    from verispec.serving.engine import Engine

    decoder, tokenizer = load(model_dirs[0], model_dirs[1], fast=False, **decoder_options)
    engine = Engine(decoder, max_batch_size=8, max_rows_per_group=4)
    engine.start()
    app = create_app(engine, tokenizer, "tiny-qwen", max_context=decoder.max_positions,
                     eos_token_ids=tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    server = LiveServer(app)
    server.engine, server.tokenizer, server.decoder, server.app = engine, tokenizer, decoder, app
    server.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    return server


def live_qwen_style(tmp_path_factory, name: str, **decoder_options):
    """A module fixture's body: the pair above saved under ``name`` and served; shut down after the module."""
    server = serve_qwen_style(save_qwen_style_pair(tmp_path_factory.mktemp(name)), **decoder_options)
    try:
        yield server
    finally:
        server.close()
        server.engine.shutdown()
