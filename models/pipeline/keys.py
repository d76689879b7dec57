"""The key a build signs its bundle with: one given with --key, the output directory's own, or
a new pair for it that is written only once the build has succeeded."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from agent.errors import ConfigError, KeyFileError
from models.pipeline.options import BuildOptions

log = logging.getLogger(__name__)


def _signing_key(options: BuildOptions) -> tuple[Any, str, Path | None]:
    """The private key to sign with, its key id, and where a newly generated pair is to be
    written once the build has succeeded (None when the key came from a file): without --key,
    the output directory's ``signing.key`` is used, or a new pair is made for it, so that a build
    that fails leaves no key behind either."""
    from models import signing

    if options.key is not None:
        key = signing.load_private_key(options.key)
        return key, signing.compute_key_id(key.public_key()), None
    default = options.out_dir / "signing.key"
    if default.exists():
        key = signing.load_private_key(default)
        public = signing.public_key_path(default)
        if not public.exists():  # devices need it; it follows from the private key
            with contextlib.suppress(KeyFileError):  # another build wrote it meanwhile
                signing.write_public_key(public, key.public_key())
                log.info("wrote the missing public key %s", public)
        return key, signing.compute_key_id(key.public_key()), None
    if signing.public_key_path(default).exists():
        raise ConfigError("the output directory has a public key but no private key to sign "
                          "with; give --key, or remove the public key to make a new pair",
                          path=signing.public_key_path(default))
    key = signing.generate_private_key()
    log.warning("no --key given: signing with a new key, written to %s when the build succeeds; "
                "devices must trust %s", default, signing.public_key_path(default))
    return key, signing.compute_key_id(key.public_key()), default


def _write_new_key(key: Any, path: Path) -> None:
    from models import signing

    signing.write_private_key(path, key)
    signing.write_public_key(signing.public_key_path(path), key.public_key())
    log.info("wrote the new signing key pair %s and %s", path, signing.public_key_path(path))


def _remove_new_key(path: Path) -> None:
    from models import signing

    for written in (path, signing.public_key_path(path)):
        with contextlib.suppress(FileNotFoundError):
            written.unlink()
