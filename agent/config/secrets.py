"""Secrets and key files the configuration names, read once at start.

``http.token_file`` becomes a :class:`Secret` (never shown in ``repr``, logs or errors) and
``trust.public_keys`` become Ed25519 public keys, so that a missing or malformed file stops the
daemon at start rather than at the first request or update. An error names the file, and the
configuration file and line that named it (as ``config_path`` and ``config_line``, since ``path``
is the secret's own file).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.errors import ConfigError, KeyFileError
from agent.fsutil import FileTooLargeError, NotARegularFileError, read_bounded
from models.signing import load_public_key

log = logging.getLogger(__name__)

REDACTED = "<redacted>"
MAX_TOKEN_FILE_BYTES = 4096


class Secret:
    """A string that never shows itself in ``repr``, ``str``, f-strings or logs.

    ``reveal()`` returns it; ``matches()`` compares a candidate in constant time (for the bearer
    token check in the HTTP API).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, candidate: str | bytes) -> bool:
        data = candidate.encode("utf-8") if isinstance(candidate, str) else candidate
        return hmac.compare_digest(self._value.encode("utf-8"), data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return self.matches(other._value)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Secret({REDACTED!r})"

    def __str__(self) -> str:
        return REDACTED


def _named_by(origin: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where a file was named, as error fields: the configuration file's ``path`` and ``line``
    become ``config_path`` and ``config_line``, beside the named file's own ``path``."""
    return {("config_" + name if name in ("path", "line") else name): value
            for name, value in (origin or {}).items()}


def read_token_file(path: Path, origin: Mapping[str, Any] | None, *,
                    key: str = "http.token_file", what: str = "token") -> Secret:
    """The bearer token (or, with ``what``, another secret: the MQTT password) in ``path``: one
    line of printable ASCII without spaces. ``key`` is the configuration key errors name.

    Raises:
        ConfigError: the file cannot be read, is not a regular file, is too large or empty, or
            holds something other than a token. Nothing of its content goes into the error.
    """

    def fail(message: str, **fields: Any) -> ConfigError:
        return ConfigError(message.replace("token", what), key=key, path=path, **fields,
                           **_named_by(origin))

    try:
        data = read_bounded(path, MAX_TOKEN_FILE_BYTES, regular_only=True)
        mode = os.stat(path).st_mode
    except NotARegularFileError:
        raise fail("token file is not a regular file") from None
    except FileTooLargeError:
        raise fail("token file is too large", expected=f"<= {MAX_TOKEN_FILE_BYTES} bytes") from None
    except OSError as exc:
        raise fail("cannot read the token file", reason=exc.strerror) from None
    # Nothing of the content goes into an error: a near-miss token is still mostly a token.
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise fail("token file is not ASCII") from None
    if not token:
        raise fail("token file is empty")
    if any(not 0x21 <= ord(character) <= 0x7E for character in token):
        raise fail("token must be one line of printable ASCII without spaces")
    if mode & stat.S_IROTH:
        log.warning("token file %s is readable by every user on this machine", path)
    return Secret(token)


def load_trusted_keys(paths: Sequence[Path], origin: Mapping[str, Any] | None, *,
                      key: str = "trust.public_keys") -> tuple[Ed25519PublicKey, ...]:
    """The public keys in ``paths``, in order.

    Raises:
        ConfigError: a key file cannot be loaded (naming ``key``: ``trust.public_keys``, or
            ``fleet.public_keys`` for the fleet's keys).
    """
    keys = []
    for path in paths:
        try:
            keys.append(load_public_key(path))
        except KeyFileError as exc:
            raise ConfigError(
                f"cannot load a trusted public key: {exc.message}", key=key,
                path=path, **{name: value for name, value in exc.fields.items() if name != "path"},
                **_named_by(origin),
            ) from exc
    return tuple(keys)
