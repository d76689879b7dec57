"""Load a user's PyTorch model from ``module:callable`` plus a checkpoint.

The callable is called with no arguments (from Python, :func:`load_user_model` passes on keyword
arguments) and must return an ``nn.Module``; to give it arguments, name a ``functools.partial`` or a
small function in a module of yours. The checkpoint may be a ``state_dict`` or a dict with a
``state_dict``/``model`` key; keys that all carry one prefix the model lacks (``module.`` from
``DataParallel``, ``model.`` from a wrapper such as a Lightning module) are matched without it. A
pruned model saved by :func:`pruning.save_pruned` is a whole module: it is loaded as it is, trusting
the classes of the callable's top-level package (whose code runs anyway once it is imported).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import ModelError, first_line

log = logging.getLogger(__name__)


def resolve_callable(spec: str) -> Callable[..., Any]:
    """Resolve ``"package.module:attribute"`` to the object it names."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ModelError("model must be given as 'module:callable'", found=spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"cannot import module '{module_name}': {exc}", model=spec) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while being imported
        raise ModelError(f"importing module '{module_name}' failed: {type(exc).__name__}: "
                         f"{first_line(exc)}", model=spec) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelError(f"module '{module_name}' has no attribute '{attribute}'") from None
    if not callable(target):
        raise ModelError(f"'{spec}' is not callable")
    return target


def load_state_dict(path: Path) -> dict[str, Any]:
    """Read a checkpoint file and return its state dict, with a clear error for bad files."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ModelError("checkpoint not found", path=path)
    if path.stat().st_size == 0:
        raise ModelError("checkpoint file is empty", path=path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files
        raise ModelError(f"cannot read checkpoint (is it a file torch.save wrote?): "
                         f"{type(exc).__name__}: {first_line(exc)}", path=path) from exc
    if isinstance(payload, dict):
        for key in ("state_dict", "model"):
            if key in payload and isinstance(payload[key], dict):
                payload = payload[key]
                break
    if not isinstance(payload, dict):
        raise ModelError("checkpoint is not a state dict", path=path)
    return payload


def load_user_model(spec: str, checkpoint: Path | None, **kwargs: Any):  # -> nn.Module
    """Build the model named by ``spec`` and load ``checkpoint`` into it (strictly).

    A checkpoint written by :func:`pruning.save_pruned` (a pruned model: its layer widths differ
    from what the callable builds) is loaded whole instead, trusting the classes of ``spec``'s
    module. A state dict saved from ``nn.DataParallel`` (every key prefixed ``module.``) loads too.
    """
    from torch import nn

    factory = resolve_callable(spec)  # also for a pruned checkpoint: a wrong name is refused
    if checkpoint is not None and _holds_pickled_objects(checkpoint):
        return _load_pruned_user_model(spec, checkpoint)
    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's factory failed
        raise ModelError(f"'{spec}' failed: {type(exc).__name__}: {first_line(exc)} (it is "
                         "called with no arguments: to give some, point at a functools.partial "
                         "or a small function of yours)") from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"'{spec}' did not return a torch.nn.Module", found=type(model).__name__)
    if checkpoint is None:
        log.warning("no --checkpoint: building '%s' with the weights its factory gives it "
                    "(untrained, unless the factory loads them)", spec)
        return model.eval()
    state = _without_common_prefix(load_state_dict(checkpoint), set(model.state_dict()))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelError(f"checkpoint does not match the model: {_mismatch(exc, model, state)}",
                         path=checkpoint) from exc
    return model.eval()


def _without_common_prefix(state: dict[str, Any], expected: set[str]) -> dict[str, Any]:
    """``state`` with a prefix every key shares (``module.``, ``model.``) removed, when that makes
    its keys the model's; else ``state`` as it is."""
    if not state or set(state) == expected:
        return state
    first = next(iter(state))
    prefix = first.split(".", 1)[0] + "." if "." in first else ""
    if not prefix or not all(key.startswith(prefix) for key in state):
        return state
    stripped = {key[len(prefix):]: value for key, value in state.items()}
    if set(stripped) != expected:
        return state
    log.info("checkpoint keys carry the prefix %r: loading them without it", prefix)
    return stripped


def _mismatch(exc: RuntimeError, model: Any, state: dict[str, Any], shown: int = 3) -> str:
    """What does not match, on one line: how many keys are missing and unexpected (the first few
    of each), or torch's complaint (shape mismatches)."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)

    def some(keys: list[str]) -> str:
        more = f", ... {len(keys) - shown} more" if len(keys) > shown else ""
        return ", ".join(keys[:shown]) + more

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) ({some(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({some(unexpected)})")
    if parts:
        return "; ".join(parts)
    lines = [line.strip() for line in str(exc).strip().splitlines()[1:] if line.strip()]
    text = "; ".join(lines) or str(exc).strip().splitlines()[0]
    return text if len(text) <= 400 else text[:397] + "..."


def _holds_pickled_objects(path: Path) -> bool:
    """Whether a checkpoint stores objects (a whole model) rather than only tensors and plain
    containers: torch lists the classes such a file needs."""
    import torch

    if not Path(path).is_file():
        return False  # load_state_dict reports the missing file
    try:
        return bool(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - not a zip checkpoint: load_state_dict says what it is
        return False


def _load_pruned_user_model(spec: str, checkpoint: Path):  # -> nn.Module
    from pruning.persist import NotAPrunedModelError, UntrustedClassError, load_pruned

    package = spec.partition(":")[0].split(".", 1)[0]
    try:
        return load_pruned(checkpoint, trusted_modules=[package]).eval()
    except NotAPrunedModelError:
        raise ModelError("the checkpoint holds pickled objects (a whole model?), not a state "
                         "dict: save model.state_dict(), or a pruned model with "
                         "pruning.save_pruned", path=checkpoint) from None
    except UntrustedClassError as exc:
        raise ModelError(f"the checkpoint holds pickled objects of a class from outside the "
                         f"package '{package}' and torch.nn, which is not loaded (pickled code "
                         "runs on load): save model.state_dict() alone, or a pruned model whose "
                         "classes live in that package with pruning.save_pruned",
                         path=checkpoint, found=exc.fields.get("found")) from None
