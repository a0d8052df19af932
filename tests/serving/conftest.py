"""Fixtures of the serving tests: the tiny model pair saved once, and the servers most tests share."""

from __future__ import annotations

import pytest
from serving_support import save_pair, serve_tiny


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_pair(tmp_path_factory.mktemp("server-models"))


@pytest.fixture(scope="session")
def live(model_dirs):
    """A fixed draft length (3): blocks of several accepted tokens on every step."""
    server = serve_tiny(model_dirs, num_draft_tokens=3)
    yield server
    server.close()
    server.engine.shutdown()


@pytest.fixture(scope="session")
def live_defaults(model_dirs):
    """The decoder's defaults: draft length chosen by the cost model, early stops by draft confidence, and
    the heuristic schedule for seeded sampling requests."""
    server = serve_tiny(model_dirs)
    assert server.decoder.num_draft_tokens == "auto" and server.decoder.stop_drafting
    yield server
    server.close()
    server.engine.shutdown()
