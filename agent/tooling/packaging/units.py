"""Reading systemd unit files (systemd.syntax(7)) as data: the tests check the settings, the
installers find each unit's ``[Install]`` targets in them.

Only what the project's units use is understood: sections, ``Key=value`` lines, comments and
repeated keys (kept in order). Line continuations are refused rather than half-parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import ConfigError

__all__ = ["Unit", "read_unit"]


@dataclass(frozen=True)
class Unit:
    """One unit file: ``settings[section]`` is a list of (key, value) in file order."""

    name: str
    settings: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def values(self, section: str, key: str) -> list[str]:
        """Every value given to ``key`` in ``section``, in order (an empty one resets, as in
        systemd, so it is kept)."""
        return [value for name, value in self.settings.get(section, []) if name == key]

    def value(self, section: str, key: str) -> str | None:
        """The last value of ``key``, as systemd takes a key given once; None when absent."""
        found = self.values(section, key)
        return found[-1] if found else None

    def words(self, section: str, key: str) -> list[str]:
        """The space-separated words of every value of a list setting (After=, DeviceAllow=...)
        since its last reset."""
        words: list[str] = []
        for value in self.values(section, key):
            if value == "":
                words = []
            words += value.split()
        return words

    def wanted_by(self) -> list[str]:
        """The targets whose ``.wants/`` directory ``systemctl enable`` links this unit into."""
        return self.words("Install", "WantedBy")


def read_unit(path: Path) -> Unit:
    """Parse ``path``.

    Raises:
        ConfigError: a line outside a section, without ``=``, or continued with ``\\``.
    """
    settings: dict[str, list[tuple[str, str]]] = {}
    section: str | None = None
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            raise ConfigError("line continuations are not supported in the project's units",
                              path=path, line=number)
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            settings.setdefault(section, [])
            continue
        key, equals, value = line.partition("=")
        if section is None or not equals:
            raise ConfigError("not a Key=value line inside a section", path=path, line=number,
                              text=line[:80])
        settings[section].append((key.strip(), value.strip()))
    return Unit(name=Path(path).name, settings=settings)
