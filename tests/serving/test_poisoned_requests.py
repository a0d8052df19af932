"""A hostile request beside healthy ones, over HTTP: every out-of-range field is a 400 naming its parameter before
admission, a failure inside the engine ends that request's choice alone (saying only "internal error" and the
request id, the traceback in the log), and the healthy requests finish with their solo greedy outputs."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving_support import MODEL, idle, ids, post

PROMPTS = ["def x ( y ) : return", "the cat + the dog", "hello world print", "if x : return y else"]
HEALTHY = {"model": MODEL, "max_tokens": 12, "temperature": 0}
BIG = 2**63

# (body fields, the param the 400 names); completions unless the body has messages.
OUT_OF_RANGE = [
    ({"min_tokens": BIG}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"seed": BIG}, "seed"),
    ({"seed": -BIG - 1}, "seed"),
    ({"max_tokens": BIG}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": BIG}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {str(BIG): 1}}, "logit_bias"),
    ({"logit_bias": {"1000": 1}}, "logit_bias"),  # beyond the vocabulary: found by the engine's validation
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"stop_token_ids": [BIG]}, "stop_token_ids"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"n": 0}, "n"),
    ({"n": BIG}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"verispec": {"draft": 65}}, "verispec"),
    ({"prompt": [[BIG]]}, "prompt"),
    ({"prompt": [1000]}, "prompt"),  # beyond the vocabulary
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": BIG}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
]


def _complete(live, prompt: str, **fields) -> dict:
    response = post(live, "/v1/completions", {**HEALTHY, "prompt": prompt, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def solo(live) -> dict[str, tuple[str, str]]:
    """Each healthy prompt's greedy text and finish reason, served alone."""
    idle(live)
    return {p: _outcome(_complete(live, p)) for p in PROMPTS}


def _outcome(response: dict) -> tuple[str, str]:
    choice = response["choices"][0]
    return choice["text"], choice["finish_reason"]


def test_out_of_range_fields_are_refused_beside_healthy_requests(live, solo) -> None:
    def poisoned(case) -> httpx.Response:
        fields, _ = case
        path = "/v1/chat/completions" if "messages" in fields else "/v1/completions"
        body = {"model": MODEL, "max_tokens": 5, "prompt": "hello world", **fields}
        if "messages" in fields:
            body.pop("prompt")
        return post(live, path, body)

    with ThreadPoolExecutor(8) as pool:
        healthy = [pool.submit(_complete, live, p) for p in PROMPTS * 2]
        refused = list(pool.map(poisoned, OUT_OF_RANGE))
    for (fields, param), response in zip(OUT_OF_RANGE, refused):
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["code"] in ("invalid_value", "invalid_type"), (fields, error)
        assert error["type"] == "invalid_request_error"
    for prompt, future in zip(PROMPTS * 2, healthy):
        assert _outcome(future.result()) == solo[prompt]
    idle(live)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_failure_ends_one_choice_and_says_only_internal_error(live, solo, stream, caplog) -> None:
    """A request whose row raises inside the engine's step (a setting forced past validation, standing for any
    bug a setting may meet in the kernels) ends with finish_reason "error" alone; its neighbours finish."""
    engine = live.engine
    submit = engine.submit

    def poisoning_submit(request, on_event):
        handle = submit(request, on_event)
        if request.seed == 424242:  # the hostile request
            row = engine._open[handle._key].row
            object.__setattr__(row.sampling, "min_tokens", 2**64)  # overflows an int64 tensor in the step
        return handle

    engine.submit = poisoning_submit
    try:
        with caplog.at_level(logging.ERROR, logger="verispec.serving"), ThreadPoolExecutor(6) as pool:
            healthy = [pool.submit(_complete, live, p) for p in PROMPTS]
            hostile = post(live, "/v1/completions", {"model": MODEL, "prompt": "hello world", "max_tokens": 8,
                                                     "temperature": 0.5, "seed": 424242, "stream": stream})
            results = [future.result() for future in healthy]
    finally:
        del engine.submit
    request_id = hostile.headers["x-request-id"]
    assert hostile.status_code == 200
    if stream:
        events = [json.loads(e.removeprefix("data: ")) for e in hostile.text.split("\n\n") if e.startswith("data: {")]
        finish = events[-1]["choices"][0]
        telemetry = events[-1]["verispec"]
    else:
        finish = hostile.json()["choices"][0]
        telemetry = hostile.json()["verispec"]["choices"][0]
    assert finish["finish_reason"] == "error"
    assert telemetry["error"] == f"internal error (request id {request_id})"
    assert "Overflow" not in hostile.text and "Traceback" not in hostile.text
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)  # the log has the cause
    for prompt, result in zip(PROMPTS, results):
        assert _outcome(result) == solo[prompt]
    idle(live)
