"""A Hub id when the Hugging Face Hub does not answer: one quick request, then the HF cache only, and one line
if the model is not there (instead of huggingface_hub's five retries per file, about a minute). The Hub is
huggingface_hub's own HTTP client with a transport that answers every request itself: nothing leaves the test."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_loading import WORDS, put_in_hub_cache, save_tiny

from verispec.acquire import hub_unreachable
from verispec.models import LoadError, load_model


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache under tmp_path, online mode (whatever the environment says)."""
    from huggingface_hub import constants

    hub = tmp_path / "hf-home" / "hub"
    hub.mkdir(parents=True)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return hub


@pytest.fixture
def hub_transport() -> Iterator[Callable[[Callable], list[str]]]:
    """``install(answer)``: every request huggingface_hub makes goes to ``answer(request)`` (which returns a
    response or raises); returns the list of requested URLs. The default client comes back afterwards."""
    import huggingface_hub
    from huggingface_hub.utils import _http, get_session

    # the HTTP library huggingface_hub is built on (httpx2 in huggingface_hub 2.x, httpx before)
    http = importlib.import_module(type(get_session()).__module__.partition(".")[0])

    def install(answer: Callable) -> list[str]:
        requested: list[str] = []

        def handler(request):
            requested.append(f"{request.method} {request.url}")
            return answer(request, http)

        huggingface_hub.set_client_factory(lambda: http.Client(transport=http.MockTransport(handler)))
        return requested

    yield install
    huggingface_hub.set_client_factory(_http.default_client_factory)


def _no_network(request, http):
    raise http.ConnectError("[Errno -2] Name or service not known", request=request)


def _file_requests(requested: list[str], repo_id: str) -> list[str]:
    """Requests for the repository's files (huggingface_hub may also ask, once, for its own registry of coding
    agents when it builds its headers in such an environment: not ours to count)."""
    return [r for r in requested if repo_id in r]


def _probes(requested: list[str]) -> list[str]:
    from huggingface_hub import constants

    return [r for r in requested if r.rstrip("/") == f"HEAD {constants.ENDPOINT}"]


def test_a_missing_hub_id_without_network_fails_after_one_request(hub_cache, hub_transport) -> None:
    requested = hub_transport(_no_network)
    progress: list[str] = []
    with pytest.raises(LoadError) as error:
        load_model("tiny-org/no-such-model", progress=progress.append)
    message = str(error.value)
    assert len(_probes(requested)) == 1 and _file_requests(requested, "tiny-org") == []  # no file, no retry
    assert "\n" not in message
    assert "'tiny-org/no-such-model'" in message and "does not answer" in message
    assert "Name or service not known" in message and str(hub_cache) in message
    assert any("local cache only" in line for line in progress)


def test_a_cached_hub_id_loads_without_network(hub_cache, hub_transport, tmp_path: Path) -> None:
    put_in_hub_cache(hub_cache, "tiny-org/tiny-llama", save_tiny(tmp_path / "tiny", WORDS))
    requested = hub_transport(_no_network)
    model, tokenizer = load_model("tiny-org/tiny-llama")
    assert model.config.vocab_size == len(WORDS) and tokenizer.get_vocab()["def"] == WORDS.index("def")
    assert len(_probes(requested)) == 1 and _file_requests(requested, "tiny-org") == []


def test_the_probe_is_one_head_request_and_any_answer_counts(hub_cache, hub_transport) -> None:
    requested = hub_transport(lambda request, http: http.Response(404))
    assert hub_unreachable() is None
    assert len(requested) == 1 and _probes(requested) == requested
    requested = hub_transport(_no_network)
    assert "Name or service not known" in hub_unreachable()


def test_offline_mode_sends_nothing(hub_cache, hub_transport, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    requested = hub_transport(_no_network)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable() is None
    with pytest.raises(LoadError, match="HF_HUB_OFFLINE is set"):
        load_model("tiny-org/no-such-model")
    assert requested == []
