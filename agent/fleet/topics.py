"""The fleet's MQTT topics (design §5.3), built and parsed in one place.

Every device has its own root ``edge/<fleet>/<device>/`` with the leaves below; the operator's
rollout documents live beside the devices under ``edge/<fleet>/rollouts/<rollout_id>``:

==============================  ========  ========  ===
topic                           writer    retained  QoS
==============================  ========  ========  ===
``.../desired``                 operator  yes       1
``.../reported``                device    yes       1
``.../events``                  device    no        1
``.../online``                  device    yes       1
``.../cmd``                     operator  no        1
``.../resp/<request_id>``       device    no        1
``edge/<fleet>/rollouts/<id>``  operator  yes       1
==============================  ========  ========  ===

Fleet, device and rollout ids are one topic level each, ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``: never
``+``, ``#`` or ``/`` (so a device id cannot widen a subscription or an ACL pattern). ``rollouts``
is not a device id, since its topics would collide with the rollout documents'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import DocumentError

__all__ = [
    "CMD",
    "DESIRED",
    "DEVICE_LEAVES",
    "EVENTS",
    "ID_PATTERN",
    "ONLINE",
    "REPORTED",
    "REQUEST_ID_PATTERN",
    "RESP",
    "ROLLOUTS",
    "ROOT",
    "ParsedTopic",
    "check_id",
    "check_request_id",
    "device_root",
    "device_topic",
    "fleet_filter",
    "parse_topic",
    "response_topic",
    "rollout_topic",
    "rollouts_filter",
]

ROOT = "edge"
DESIRED = "desired"
REPORTED = "reported"
EVENTS = "events"
ONLINE = "online"
CMD = "cmd"
RESP = "resp"
ROLLOUTS = "rollouts"
DEVICE_LEAVES = (DESIRED, REPORTED, EVENTS, ONLINE, CMD)

ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_ID_RULE = "1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit"
_REQUEST_ID_RULE = "1-64 characters of [A-Za-z0-9_.:-]"
_RESERVED_DEVICE_IDS = frozenset({ROLLOUTS})


def check_id(value: object, what: str = "device") -> str:
    """``value`` if it is a valid ``fleet``, ``device`` or ``rollout`` id.

    Raises:
        DocumentError: (reason ``bad_id``) naming ``what`` and the value found.
    """
    if not isinstance(value, str) or ID_PATTERN.fullmatch(value) is None:
        raise DocumentError(f"invalid {what} id", reason="bad_id", field=what,
                            expected=_ID_RULE, found=repr(value))
    if what == "device" and value in _RESERVED_DEVICE_IDS:
        raise DocumentError(f"'{value}' is reserved and cannot be a device id", reason="bad_id",
                            field=what, found=repr(value))
    return value


def check_request_id(value: object) -> str:
    """``value`` if it is a valid command request id (reason ``bad_id`` otherwise)."""
    if not isinstance(value, str) or REQUEST_ID_PATTERN.fullmatch(value) is None:
        raise DocumentError("invalid request id", reason="bad_id", field="request_id",
                            expected=_REQUEST_ID_RULE, found=repr(value))
    return value


def device_root(fleet: str, device: str) -> str:
    """``edge/<fleet>/<device>``, both ids checked."""
    return f"{ROOT}/{check_id(fleet, 'fleet')}/{check_id(device, 'device')}"


def device_topic(fleet: str, device: str, leaf: str) -> str:
    """One of a device's topics: ``leaf`` is ``desired``, ``reported``, ``events``,
    ``online`` or ``cmd`` (a response topic is :func:`response_topic`'s)."""
    if leaf not in DEVICE_LEAVES:
        raise DocumentError("unknown device topic", reason="bad_topic", field="leaf",
                            expected=", ".join(DEVICE_LEAVES), found=repr(leaf))
    return f"{device_root(fleet, device)}/{leaf}"


def response_topic(fleet: str, device: str, request_id: str) -> str:
    """``edge/<fleet>/<device>/resp/<request_id>``, where the device answers a command."""
    return f"{device_root(fleet, device)}/{RESP}/{check_request_id(request_id)}"


def rollout_topic(fleet: str, rollout_id: str) -> str:
    """``edge/<fleet>/rollouts/<rollout_id>``, a rollout's retained state document."""
    return f"{ROOT}/{check_id(fleet, 'fleet')}/{ROLLOUTS}/{check_id(rollout_id, 'rollout')}"


def fleet_filter(fleet: str, leaf: str) -> str:
    """A subscription to one leaf of every device of a fleet: ``edge/<fleet>/+/<leaf>``
    (``resp`` gives ``edge/<fleet>/+/resp/+``)."""
    if leaf == RESP:
        return f"{ROOT}/{check_id(fleet, 'fleet')}/+/{RESP}/+"
    if leaf not in DEVICE_LEAVES:
        raise DocumentError("unknown device topic", reason="bad_topic", field="leaf",
                            expected=", ".join((*DEVICE_LEAVES, RESP)), found=repr(leaf))
    return f"{ROOT}/{check_id(fleet, 'fleet')}/+/{leaf}"


def rollouts_filter(fleet: str) -> str:
    """A subscription to every rollout document of a fleet: ``edge/<fleet>/rollouts/+``."""
    return f"{ROOT}/{check_id(fleet, 'fleet')}/{ROLLOUTS}/+"


@dataclass(frozen=True)
class ParsedTopic:
    """A topic taken apart. For a device's topic ``device`` is set and ``leaf`` is one of
    :data:`DEVICE_LEAVES` or ``resp`` (then ``rest`` is the request id); for a rollout document
    ``device`` is None, ``leaf`` is ``rollouts`` and ``rest`` the rollout id."""

    fleet: str
    device: str | None
    leaf: str
    rest: str | None = None

    @property
    def request_id(self) -> str | None:
        return self.rest if self.leaf == RESP else None

    @property
    def rollout_id(self) -> str | None:
        return self.rest if self.leaf == ROLLOUTS else None


def parse_topic(topic: str) -> ParsedTopic:
    """Take a fleet topic apart.

    Raises:
        DocumentError: (reason ``bad_topic``) the topic is not one of the fleet's topics.
    """
    parts = topic.split("/") if isinstance(topic, str) else []
    try:
        if len(parts) < 4 or parts[0] != ROOT:
            raise ValueError
        fleet = check_id(parts[1], "fleet")
        if parts[2] == ROLLOUTS:
            if len(parts) != 4:
                raise ValueError
            return ParsedTopic(fleet, None, ROLLOUTS, check_id(parts[3], "rollout"))
        device = check_id(parts[2], "device")
        leaf = parts[3]
        if leaf == RESP and len(parts) == 5:
            return ParsedTopic(fleet, device, RESP, check_request_id(parts[4]))
        if leaf in DEVICE_LEAVES and len(parts) == 4:
            return ParsedTopic(fleet, device, leaf)
        raise ValueError
    except (ValueError, DocumentError):
        raise DocumentError("not a fleet topic", reason="bad_topic", field="topic",
                            expected="edge/<fleet>/<device>/<leaf> or "
                                     "edge/<fleet>/rollouts/<id>",
                            found=repr(topic)) from None
