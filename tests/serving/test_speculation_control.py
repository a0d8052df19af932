"""Per-request speculation control: the ``verispec`` extension object (draft off / auto / a fixed length,
verification) through the official ``openai`` client, streamed and not, and the library's per-call ``draft=None`` / ``num_draft_tokens``."""

from __future__ import annotations

import pytest
from serving_support import MODEL, extra, post
from tiny_models import AlwaysDraft


@pytest.fixture
def drafting(live):
    """The live server's decoder under a controller that lets every row draft its request's maximum: whether
    drafting pays these tiny models is the real controller's call (tests/policy/test_controller.py), and these
    tests are about what a request's own length means."""
    controller, live.decoder.controller = live.decoder.controller, AlwaysDraft()
    try:
        yield live
    finally:
        live.decoder.controller = controller

PROMPT = "def x ( y ) : return the cat + the dog"


def _telemetry(live, draft, stream: bool = False, **options) -> tuple[str, dict]:
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
              "extra_body": {"verispec": {"draft": draft, **options}}}
    if stream:
        chunks = list(live.client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finished = [extra(c, "verispec") for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finished[-1]
    response = live.client.completions.create(**kwargs)
    return response.choices[0].text, extra(response, "verispec")


@pytest.mark.parametrize("stream", [False, True])
def test_draft_off_fixed_and_auto_give_the_same_text(drafting, stream) -> None:
    live = drafting
    off_text, off = _telemetry(live, "off", stream)
    assert off["draft_tokens"] == 0 and off["tokens_per_target_pass"] == pytest.approx(1.0)
    two_text, two = _telemetry(live, 2, stream)
    assert 0 < two["mean_draft_length"] <= 2 and two["draft_tokens"] > 0
    auto_text, _ = _telemetry(live, "auto", stream)
    zero_text, zero = _telemetry(live, 0, stream)
    assert zero["draft_tokens"] == 0
    assert off_text == two_text == auto_text == zero_text  # greedy: speculation never changes the output


def test_verification_is_chosen_per_request(live) -> None:
    for verification in ("token", "block"):
        kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.8, "seed": 4,
                  "extra_body": {"verispec": {"draft": 3, "verification": verification}}}
        response = live.client.completions.create(**kwargs)
        assert extra(response, "verispec")["draft_tokens"] > 0


@pytest.mark.parametrize("options", [{"draft": -1}, {"draft": "sometimes"}, {"draft": 1000}, {"draft": 2.5},
                                     {"verification": "tree"}, {"no_such_option": 1}])
def test_bad_speculation_options_are_refused(live, options) -> None:
    response = post(live, "/v1/completions", {"model": MODEL, "prompt": "x", "verispec": options})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "verispec"


def test_library_draft_off_per_call(drafting) -> None:
    live = drafting
    prompt_ids = live.tokenizer(PROMPT)["input_ids"]
    off = live.decoder.generate([prompt_ids], max_new_tokens=8, draft=None)
    on = live.decoder.generate([prompt_ids], max_new_tokens=8, num_draft_tokens=3)
    assert off.stats.draft_tokens == 0 and off.stats.draft_calls == 0 and on.stats.draft_tokens > 0
    assert off.tokens == on.tokens
