"""The dynamic batcher: queues requests and runs them in batches on the backend instances.

It lives on the HTTP server's asyncio loop; each backend instance has two worker threads, one that
copies a formed batch into the instance's staged buffers and one that runs it, so a full batch is
assembled while the previous one computes.

When a batch goes (Triton's rules, see docs/reference/serving.md §1):

* An idle instance takes requests as soon as they make a full batch (``max_batch_size``) or the
  leading ones add up to exactly a preferred size (the largest such run is sent), when the oldest
  request has waited ``max_queue_delay_us``, or when waiting longer would let a queued request's
  deadline pass.
* While every instance is busy, the pending batch keeps growing; only a full batch is staged ahead
  into an instance's spare buffer set, so nothing is cut short just because an instance was busy.
* Requests are taken by priority (1 is the highest), first come first served within a level, and a
  batch only joins requests whose per-sample shapes match (one bundle serves several frame sizes).
* A request whose deadline passes before its batch starts to run (queued, or staged behind the
  running batch) is answered with :class:`DeadlineExceeded`, never with a late result; queue time
  runs until the batch starts. A request's timeout may only shorten ``default_timeout_us``. A full
  queue rejects new requests at once with :class:`QueueFull` (the API answers 503); a cancelled
  request (its HTTP client went away) leaves the queue at once.
* A failed batch fails only its own requests, each with the error.
* The power governor's sleep may release the instances' engines (``release_engine_in_sleep``,
  :class:`~agent.batcher.batcher.EngineState`): nothing is dispatched until they are re-created,
  which the wake or the first request that comes starts; a request that comes meanwhile waits
  (its deadline still counts), and one whose restore fails gets :class:`EngineUnavailable`
  (HTTP 503) with the cause.

What happens is reported to one observer (agent/observers.py: the model's metrics, statistics
and whatever else subscribed); a snapshot of the load comes from :meth:`Batcher.load`.

Modules: ``batcher`` (the :class:`Batcher`: queues, batch forming, dispatch), ``policy`` (its
settings, errors and results), ``work`` (a batch's requests and the worker threads' two steps).
"""

from agent.batcher.batcher import Batcher
from agent.batcher.policy import (
    MAX_TIMEOUT_US,
    BatchPolicy,
    DeadlineExceeded,
    EngineUnavailable,
    InferenceResult,
    LoadSnapshot,
    NotServing,
    QueueFull,
)

__all__ = [
    "MAX_TIMEOUT_US",
    "BatchPolicy",
    "Batcher",
    "DeadlineExceeded",
    "EngineUnavailable",
    "InferenceResult",
    "LoadSnapshot",
    "NotServing",
    "QueueFull",
]
