"""What an operator decides for ``verispec serve``: who may call it, how much work it accepts, how it stops.

``ServerOptions`` holds the settings the app enforces (``create_app(..., options=...)``); the helpers below turn
the command line and the environment into them: API keys (``--api-key``, ``VERISPEC_API_KEY``,
``--api-key-file``), the Host allow-list (loopback names by default on a loopback address) and the model id
clients send (the model's own name, never a filesystem path).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "VERISPEC_API_KEY"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
MAX_CHOICES = 256  # prompts x n in one request, whatever the options say (the request schema's bound)


@dataclass(frozen=True)
class ServerOptions:
    """Security and admission settings of one app. The defaults are those of ``verispec serve``, except
    ``allowed_hosts`` (the command line restricts it to loopback names on a loopback address)."""

    api_keys: tuple[str, ...] = ()  # Bearer keys for /v1/* (and /metrics); empty: no authentication
    metrics_public: bool = False  # /metrics without a key even when keys are set
    allowed_hosts: tuple[str, ...] | None = None  # Host header allow-list (Starlette patterns); None: any
    docs: bool = False  # /docs and /redoc
    playground: bool = True  # the playground page at /playground (and / redirecting to it)
    max_request_bytes: int = 2**20  # request body, checked while it is read (413)
    max_choices: int = 32  # prompts x n per request (400)
    max_request_tokens: int = 65536  # prompts x n x max_tokens per request (400)
    max_queued_tokens: int = 262144  # the same, summed over admitted requests not finished (429)
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM / SIGINT

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_choices", "max_request_tokens", "max_queued_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_choices > MAX_CHOICES:
            raise ValueError(f"max_choices must be at most {MAX_CHOICES}, got {self.max_choices}")
        if self.max_request_tokens < self.max_choices:
            raise ValueError("max_request_tokens must be at least max_choices (one token per choice)")
        if self.max_queued_tokens < self.max_request_tokens:
            raise ValueError("max_queued_tokens must be at least max_request_tokens, or no request could run")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        for key in self.api_keys:
            if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty printable ASCII without spaces")


def read_api_keys(keys: Sequence[str] = (), key_file: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Every key given: ``keys`` (``--api-key``, repeatable), ``VERISPEC_API_KEY`` (one key, or several separated
    by commas) and ``key_file`` (one key a line; blank lines and lines starting with ``#`` skipped).

    A key that is empty or blank, from any source, is a ``ValueError``: it would otherwise start a server
    without authentication that its operator believes protected (``--api-key "$UNSET_VARIABLE"``)."""
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key is empty: give a key, or leave the option out for a server without one")
    found = [key.strip() for key in keys]
    if API_KEY_ENV in environ:
        given = environ[API_KEY_ENV].split(",")
        if any(not key.strip() for key in given):
            raise ValueError(f"{API_KEY_ENV} holds an empty key: set it to one key or several separated by commas, "
                             "or unset it for a server without one")
        found += [key.strip() for key in given]
    if key_file is not None:
        try:
            lines = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the API key file: {error}") from error
        file_keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not file_keys:
            raise ValueError(f"the API key file {key_file} holds no key")
        found += file_keys
    return tuple(dict.fromkeys(found))


def is_loopback(host: str) -> bool:
    """True for an address that only this machine can reach (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str, given: Sequence[str] | None = None) -> tuple[str, ...] | None:
    """The Host allow-list: ``given`` (``--allowed-hosts``; ``*`` allows any), else loopback names when bound to
    a loopback address (a web page cannot then reach the server through a DNS name it controls), else any."""
    if given:
        hosts = tuple(h.strip().lower() for item in given for h in item.split(",") if h.strip())
        return None if "*" in hosts else hosts
    if not is_loopback(bind_host):
        return None
    own = f"[{bind_host}]" if ":" in bind_host else bind_host.lower()
    return tuple(dict.fromkeys((*LOOPBACK_HOSTS, own)))


def default_model_name(target: str) -> str:
    """The model id clients send: a zoo name or Hub id as given; for a folder or ``.gguf`` file on disk, its own
    name (``/models/Qwen2.5-1.5B`` -> ``Qwen2.5-1.5B``): the server never shows a filesystem path."""
    path = Path(target).expanduser()
    if not path.exists():
        return target
    path = path.resolve()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def startup_warnings(options: ServerOptions, bind_host: str) -> list[str]:
    """What an operator should hear before the server starts (printed by ``verispec serve``)."""
    warnings = []
    if not options.api_keys and not is_loopback(bind_host):
        warnings.append(f"WARNING: no API key and bound to {bind_host}: anyone who can reach this port can use the "
                        f"server; set --api-key, {API_KEY_ENV} or --api-key-file")
    if options.allowed_hosts is None and not is_loopback(bind_host):
        warnings.append("note: any Host header is accepted; behind a reverse proxy, --allowed-hosts names the "
                        "host names clients use")
    return warnings
