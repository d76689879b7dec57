"""``--profile-shape``: the engine profile given by hand, as trtexec's ``--minShapes``,
``--optShapes`` and ``--maxShapes`` give it: ``NAME:MIN,OPT,MAX`` with each shape written
``1x3x48x320``, once per input.

It replaces what the build would find by running the model (:mod:`models.input_sizes`): the
first input's height and width spans and the batch range. The batch range is the one
``--max-batch`` and ``--opt-batch`` set otherwise: given with it, they must agree (the command
line fills them in from it when they are left out). The shapes are checked here as far as the
options and the model's declared inputs allow (syntax, order, rank, names, fixed axes, agreement
between inputs); whether the model runs at them is checked by running it
(:mod:`models.pipeline.profile`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import ConfigError

KEY = "--profile-shape"
EXAMPLE = "x:1x3x48x32,8x3x48x320,32x3x48x640"


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(int(dim)) for dim in shape)


@dataclass(frozen=True)
class ProfileShape:
    """One input's shapes in the engine profile: the smallest, the one TensorRT tunes for, and
    the largest. Checked when made: one rank, positive sizes, ``min <= opt <= max`` per axis."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError(f"{KEY} needs an input name before the colon (e.g. {EXAMPLE})",
                              key=KEY)
        if len({len(self.min), len(self.opt), len(self.max)}) != 1 or not self.min:
            raise ConfigError(f"{KEY} {self.name}: min, opt and max must have the same number "
                              f"of axes (e.g. {EXAMPLE})", key=KEY, found=self.text())
        if not all(dim >= 1 for shape in self.shapes() for dim in shape):
            raise ConfigError(f"{KEY} {self.name}: every size must be at least 1", key=KEY,
                              found=self.text())
        for axis, (low, mid, high) in enumerate(zip(self.min, self.opt, self.max)):
            if not low <= mid <= high:
                ordered = ProfileShape(self.name, *zip(*(sorted(sizes) for sizes in zip(
                    self.min, self.opt, self.max))))
                raise ConfigError(f"{KEY} {self.name}: axis {axis} must satisfy min <= opt <= "
                                  f"max, not {low}, {mid}, {high} (e.g. {ordered.text()})",
                                  key=KEY, found=self.text())

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return self.min, self.opt, self.max

    @property
    def batch(self) -> list[int]:
        return [self.min[0], self.opt[0], self.max[0]]

    def span(self, axis: int) -> list[int]:
        return [shape[axis] for shape in self.shapes()]

    def text(self) -> str:
        """As it is written on the command line."""
        return f"{self.name}:" + ",".join(shape_text(shape) for shape in self.shapes())


def parse_profile_shape(text: str) -> ProfileShape:
    """``NAME:MIN,OPT,MAX`` as a :class:`ProfileShape`; the name is everything before the last
    colon (ONNX names may hold one: ``input:0``).

    Raises:
        ConfigError: bad syntax or values (one line, with an example that parses).
    """
    name, colon, shapes = text.strip().rpartition(":")
    parts = shapes.split(",")
    wanted = (f"{KEY} takes NAME:MIN,OPT,MAX with each shape as sizes joined by x "
              f"(e.g. {EXAMPLE})")
    if not colon or len(parts) != 3:
        raise ConfigError(wanted, key=KEY, found=text)
    try:
        parsed = [tuple(int(size) for size in part.lower().split("x")) for part in parts]
    except ValueError:
        raise ConfigError(wanted, key=KEY, found=text) from None
    return ProfileShape(name.strip(), *parsed)


def check_profile_options(shapes: Sequence[ProfileShape], max_batch: int, opt_batch: int) -> None:
    """What can be checked of ``--profile-shape`` without the model: one entry per input, one
    batch range for all, a range the daemon can serve (it sends single requests: the smallest
    batch is 1, or the only one, padded to), and agreement with ``--max-batch``/``--opt-batch``.

    Raises:
        ConfigError: names the entries that disagree and what would agree.
    """
    if not shapes:
        return
    names = [shape.name for shape in shapes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"{KEY} names an input twice; give one per input", key=KEY,
                          found=twice)
    batch = shapes[0].batch
    for shape in shapes[1:]:
        if shape.batch != batch:
            raise ConfigError(f"{KEY}: every input's batch (the first size) must be the same; "
                              f"{shapes[0].name} has {_span(batch)} and {shape.name} "
                              f"{_span(shape.batch)}", key=KEY)
    if batch[0] != 1 and len(set(batch)) > 1:
        raise ConfigError(f"{KEY}: the smallest batch must be 1 (the daemon runs single "
                          f"requests), or min, opt and max batch the same (smaller batches are "
                          f"padded to it); e.g. {_with_batch(shapes[0], [1, *batch[1:]])}",
                          key=KEY, found=shapes[0].text())
    if [opt_batch, max_batch] != batch[1:]:
        raise ConfigError(f"{KEY} sets the batch range ({_span(batch)}): leave out --max-batch "
                          f"and --opt-batch, or give them as its max and opt", key=KEY,
                          max_batch=max_batch, opt_batch=opt_batch)


def given_profile(shapes: Sequence[ProfileShape], meta: dict[str, Any],
                  declared: Mapping[str, Sequence[int]], frame_given: bool
                  ) -> dict[str, list[int]]:
    """The engine profile ``shapes`` give (``batch`` and the first input's dynamic ``height`` and
    ``width``), checked against the model: ``declared`` is each input's shape in the graph (-1
    for a dynamic axis), ``meta`` the build's (:func:`models.pipeline.sources._input_meta`).

    Raises:
        ConfigError: an unknown input, a wrong rank, a fixed axis given another size, the first
            input left out while its height or width is dynamic, another input that disagrees
            with the first, or ``--frame-size`` given as well.
    """
    from models.onnx_model import spatial_axes
    from models.pipeline.frames import _frame_inputs

    by_name = {shape.name: shape for shape in shapes}
    first = str(meta["input_name"])
    for shape in shapes:
        _check_against_model(shape, meta, declared)
    batch = shapes[0].batch
    profile: dict[str, list[int]] = {"batch": batch}
    axes = spatial_axes(meta["layouts"].get(first))
    dynamic = list(meta["dynamic_hw"]) if axes is not None else []
    if dynamic and first not in by_name:
        example = ProfileShape(first, *(_frame_inputs(meta, size, None)[first][0]
                                        for size in batch))
        raise ConfigError(f"{KEY} must give the first input {first!r}: the engine profile's "
                          f"height and width are its (e.g. {example.text()}, at its calibration "
                          "size)", key=KEY, given=sorted(by_name))
    if first in by_name and frame_given:
        raise ConfigError(f"{KEY} {first} sets the deployment frame (its opt): leave out "
                          "--frame-size", key="--frame-size")
    frames: list[tuple[int | None, int | None]] = [(None, None)] * 3
    if dynamic and axes is not None:
        given = by_name[first]
        spans = {name: given.span(axis) for name, axis in zip(("height", "width"), axes)}
        profile.update({name: spans[name] for name in dynamic})
        # The frame's entry for a fixed axis is not used (_frame_inputs).
        frames = [(spans["height"][bound], spans["width"][bound]) for bound in range(3)]
    for shape in shapes:
        expected = ProfileShape(shape.name, *(
            _frame_inputs(meta, size, frame)[shape.name][0] for size, frame in zip(batch, frames)))
        if expected != shape:
            raise ConfigError(f"{KEY} {shape.name} must be {expected.text()}: the engine profile "
                              f"gives every input {first}'s batch and height and width where "
                              "they match its calibration size, and otherwise the calibration "
                              "samples' size", key=KEY, found=shape.text())
    return profile


def _check_against_model(shape: ProfileShape, meta: dict[str, Any],
                         declared: Mapping[str, Sequence[int]]) -> None:
    model_shape = declared.get(shape.name)
    if model_shape is None:
        raise ConfigError(f"{KEY} names {shape.name!r}, which is not an input of the model "
                          f"(its inputs: {', '.join(declared)})", key=KEY)
    if len(shape.min) != len(model_shape):
        raise ConfigError(f"{KEY} {shape.name} has {len(shape.min)} axes; the input has "
                          f"{len(model_shape)} ({_declared(model_shape)})", key=KEY,
                          found=shape.text())
    fixed_batch = meta.get("fixed_batch")
    if fixed_batch is not None and set(shape.batch) != {int(fixed_batch)}:
        raise ConfigError(f"{KEY} {shape.name}: the model's batch is fixed at {fixed_batch}; "
                          f"give it as min, opt and max (e.g. "
                          f"{_with_batch(shape, [int(fixed_batch)] * 3)})", key=KEY,
                          found=shape.text())
    for axis, dim in enumerate(model_shape):
        if dim >= 0 and set(shape.span(axis)) != {dim}:
            fixed = ProfileShape(shape.name, *(tuple(dim if index == axis else size
                                                     for index, size in enumerate(sizes))
                                               for sizes in shape.shapes()))
            raise ConfigError(f"{KEY} {shape.name}: axis {axis} is fixed at {dim} in the model "
                              f"({_declared(model_shape)}); e.g. {fixed.text()}", key=KEY,
                              found=shape.text())


def _declared(shape: Sequence[int]) -> str:
    return "[" + ", ".join("?" if dim < 0 else str(dim) for dim in shape) + "]"


def _span(batch: Sequence[int]) -> str:
    return "..".join(str(size) for size in batch)


def _with_batch(shape: ProfileShape, batch: Sequence[int]) -> str:
    return ProfileShape(shape.name, *((size, *dims[1:])
                                      for size, dims in zip(batch, shape.shapes()))).text()
