"""What the serving path reports as it works, and the components that subscribe to it.

The batcher reports every answered request (:class:`RequestDone`), every executed batch
(:class:`BatchDone`) and every change of its queue depth to one :class:`Observers`, which hands
each report on to its subscribers: the Prometheus metrics and Triton's statistics today; the power
governor (arrival rate, queue depth, latency against its target) and the updater's canary
(errors and latency per model version) are the next ones. A subscriber derives from
:class:`ServingObserver` and overrides what it needs.

Reports arrive on the event loop, one at a time, on the serving path: a subscriber must be quick
and must never block or await. One that raises is logged once and unsubscribed, so an observer's
bug never fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: How a request ended: its answer, or why it got none.
OUTCOMES = ("success", "failure", "timeout", "invalid", "rejected", "cancelled")


@dataclass(frozen=True, slots=True)
class RequestDone:
    """A request answered by the batcher (or abandoned by its client: ``cancelled``)."""

    outcome: str  # one of OUTCOMES
    version: int  # the model version whose instance ran it (or was serving when it ended)
    total_s: float  # from arrival at the batcher to its answer
    queue_s: float  # waiting until its batch ran, less compute_input (all of it if it never ran)
    compute_input_s: float = 0.0  # copying its batch's inputs into the instance's buffers
    compute_s: float = 0.0  # its batch on the backend
    compute_output_s: float = 0.0  # cutting its rows out of the batch's outputs
    # It waited for the board to wake (the wake hook, a sleep's engine restore) or ran in a
    # restored engine's first batch: its latency is the wake's as much as its version's
    after_wake: bool = False
    # Of an after_wake request: its latency from when dispatch resumed after the wake or the
    # restore (from its arrival, when later), the wait left out; the gates judge these apart
    awake_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A batch the backend ran."""

    version: int
    batch_size: int  # samples, over all its requests
    compute_s: float  # on the backend
    compute_input_s: float = 0.0  # copying its requests' inputs into the instance's buffers
    compute_output_s: float = 0.0  # cutting its outputs into per-request arrays


class ServingObserver:
    """Receives the serving path's reports; each method does nothing unless overridden."""

    def request_done(self, event: RequestDone) -> None:
        """A request was answered."""

    def batch_done(self, event: BatchDone) -> None:
        """A batch ran."""

    def queue_depth(self, depth: int) -> None:
        """The number of queued requests changed."""


class Observers(ServingObserver):
    """Hands each report to every subscriber, in the order they subscribed."""

    def __init__(self, *subscribers: ServingObserver) -> None:
        # A tuple, replaced on every change: a report in progress walks the one it started with.
        self._subscribers: tuple[ServingObserver, ...] = subscribers

    def subscribe(self, subscriber: ServingObserver) -> Callable[[], None]:
        """Add a subscriber; returns the function that removes it again."""
        self._subscribers = (*self._subscribers, subscriber)
        return lambda: self.unsubscribe(subscriber)

    def unsubscribe(self, subscriber: ServingObserver) -> None:
        self._subscribers = tuple(item for item in self._subscribers if item is not subscriber)

    def request_done(self, event: RequestDone) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber.request_done(event)
            except Exception as exc:  # noqa: BLE001 - an observer's bug must not fail requests
                self._drop(subscriber, exc)

    def batch_done(self, event: BatchDone) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber.batch_done(event)
            except Exception as exc:  # noqa: BLE001
                self._drop(subscriber, exc)

    def queue_depth(self, depth: int) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber.queue_depth(depth)
            except Exception as exc:  # noqa: BLE001
                self._drop(subscriber, exc)

    def _drop(self, subscriber: ServingObserver, exc: Exception) -> None:
        log.error("serving observer %s failed and is unsubscribed", type(subscriber).__name__,
                  exc_info=exc)
        self.unsubscribe(subscriber)
