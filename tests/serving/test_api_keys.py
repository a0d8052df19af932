"""An empty or blank API key, from any source, refuses to start the server (exit 2, one line), as an empty key
file does: it would otherwise run without authentication while its operator believes it protected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from verispec.cli import main
from verispec.serving.config import API_KEY_ENV, read_api_keys

BLANK_FLAGS = [[""], [" "], ["good-key", "\t"]]
BLANK_ENV = ["", " ", " , ", "good-key,", "a,,b"]


@pytest.mark.parametrize("flags", BLANK_FLAGS)
def test_a_blank_flag_key_is_refused(flags) -> None:
    with pytest.raises(ValueError, match="--api-key is empty"):
        read_api_keys(flags, None, environ={})


@pytest.mark.parametrize("value", BLANK_ENV)
def test_a_blank_environment_key_is_refused(value) -> None:
    with pytest.raises(ValueError, match=f"{API_KEY_ENV} holds an empty key"):
        read_api_keys([], None, environ={API_KEY_ENV: value})


def test_keys_that_are_there_still_read() -> None:
    assert read_api_keys([" a "], None, environ={API_KEY_ENV: "b, c"}) == ("a", "b", "c")
    assert read_api_keys([], None, environ={}) == ()  # no source at all: a server without keys (loopback)


@pytest.mark.parametrize("argv, environ", [(["--api-key", ""], {}), (["--api-key", " "], {}),
                                           ([], {API_KEY_ENV: ""}), ([], {API_KEY_ENV: " , "})])
def test_serve_exits_2_in_one_line_before_loading(argv, environ, capsys, monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    code = main(["serve", "--target", "/no/such/model", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "empty" in err and "does not exist" not in err, err


def test_the_command_exits_2(tmp_path) -> None:
    """The installed entry point's exit status, in a process of its own."""
    environ = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {API_KEY_ENV: " , "}
    done = subprocess.run([sys.executable, "-m", "verispec.cli", "serve", "--target", str(tmp_path / "none")],
                          env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert f"{API_KEY_ENV} holds an empty key" in done.stderr
