"""Load a user's PyTorch model from ``module:callable`` plus a checkpoint.

The callable is called with no arguments (or with ``num_classes`` when given) and must return an
``nn.Module``. The checkpoint may be a ``state_dict`` or a dict with a ``state_dict``/``model`` key.
A pruned model saved by :func:`pruning.save_pruned` is a whole module and loads without a callable.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.errors import ModelError

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
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files
        raise ModelError(f"cannot read checkpoint: {exc}", path=path) from exc
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

    if checkpoint is not None and _holds_pickled_objects(checkpoint):
        return _load_pruned_user_model(spec, checkpoint)
    model = resolve_callable(spec)(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelError(f"'{spec}' did not return a torch.nn.Module", found=type(model).__name__)
    if checkpoint is not None:
        state = load_state_dict(checkpoint)
        if state and all(key.startswith("module.") for key in state):
            state = {key[len("module."):]: value for key, value in state.items()}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ModelError(f"checkpoint does not match the model: {_mismatch(exc)}",
                             path=checkpoint) from exc
    return model.eval()


def _mismatch(exc: RuntimeError, limit: int = 400) -> str:
    """torch's load_state_dict complaint (missing and unexpected keys, shape mismatches) on one
    line, without its header."""
    lines = [line.strip() for line in str(exc).strip().splitlines()[1:] if line.strip()]
    text = "; ".join(lines) or str(exc).strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

    module_name = spec.partition(":")[0]
    try:
        return load_pruned(checkpoint, trusted_modules=[module_name]).eval()
    except NotAPrunedModelError:
        raise ModelError("the checkpoint holds pickled objects (a whole model?), not a state "
                         "dict: save model.state_dict(), or a pruned model with "
                         "pruning.save_pruned", path=checkpoint) from None
    except UntrustedClassError as exc:
        raise ModelError(f"the checkpoint needs a class from outside '{module_name}' and "
                         "torch.nn, which is not loaded (pickled code runs on load)",
                         path=checkpoint, found=exc.fields.get("found")) from None
