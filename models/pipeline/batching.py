"""What a build does with the model's batch axis (models.batch_axis finds it): the report's
``batch`` section and warnings, and the batch sizes the bundle is built and served for."""

from __future__ import annotations

import logging
from typing import Any

from models.batch_axis import BatchAxes
from models.pipeline.options import BuildOptions

log = logging.getLogger(__name__)


def note_batch(batch: BatchAxes, options: BuildOptions, report: dict[str, Any]) -> None:
    """Fill the report's ``batch`` section, and say in the log and the report's warnings when
    the bundle is built for one batch size only, or splits an output on another axis than 0."""
    report["batch"] = batch.to_report()
    if batch.fixed is not None:
        ignored = [f"{flag} {value}" for flag, value in (("--max-batch", options.max_batch),
                                                         ("--opt-batch", options.opt_batch))
                   if value != batch.fixed]
        message = (f"the model's graph runs at batch {batch.fixed} only ({batch.reason}): the "
                   f"bundle is built for batch {batch.fixed}, and the daemon pads smaller batches "
                   f"to it and batches no more requests together than that"
                   + (f" ({', '.join(ignored)} do not apply)" if ignored else ""))
        log.warning("%s", message)
        report.setdefault("warnings", []).append(message)
    for name, axis in batch.output_axes.items():
        if axis != 0:
            log.info("output %r carries the batch on axis %d: the daemon cuts its batches into "
                     "requests on that axis (the manifest's output_batch_axes)", name, axis)


def bundle_batches(meta: dict[str, Any], options: BuildOptions) -> dict[str, Any]:
    """The manifest's batch fields: ``max_batch`` and ``opt_batch`` (the options', or the fixed
    batch of a graph that takes only that one, with ``fixed_batch`` saying so), and
    ``output_batch_axes`` where an output carries the batch on another axis than 0."""
    fixed = meta.get("fixed_batch")
    fields: dict[str, Any] = {"max_batch": fixed or options.max_batch,
                              "opt_batch": fixed or options.opt_batch}
    if fixed is not None:
        fields["fixed_batch"] = fixed
    axes = {name: axis for name, axis in (meta.get("output_batch_axes") or {}).items() if axis}
    if axes:
        fields["output_batch_axes"] = axes
    return fields
