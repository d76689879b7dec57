"""Save and load a pruned model: the whole module, read back through torch's weights-only loader.

A pruned model no longer matches the architecture its class builds (its layers are narrower), so a
plain ``state_dict`` cannot be loaded into a fresh instance. Two ways were considered:

* torch-pruning's ``tp.state_dict`` / ``tp.load_state_dict``: it copies every module's
  ``__dict__``, child modules included, so the file holds pickled module objects anyway (torch
  2.13 refuses it with ``weights_only=True``), and loading also needs a fresh unpruned model,
  i.e. a record of the factory and its arguments. It adds a dependency without adding safety.
* ``torch.save`` of the whole module (chosen): every width and attribute torch-pruning changed is
  kept, and loading needs no factory. Unpickling a whole module with ``weights_only=False`` would
  run any code the file names, so :func:`load_pruned` does not do that: it lists the classes the
  file refers to, allows only ``nn.Module`` subclasses from trusted packages (``torch.nn``, this
  project's model zoo, and what the caller adds), and loads with ``weights_only=True`` with just
  those allowed. A file naming anything else is refused before any of it is unpickled.

The file holds a small dict: a format tag and version, the torch and torch-pruning versions that
wrote it, the model's class, its conv widths, and the model.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch_pruning as tp
from torch import nn

from agent.errors import ModelError
from agent.fsutil import atomic_output_file
from pruning.report import conv_widths

FORMAT = "jetson-edge-agent/pruned-model"
FORMAT_VERSION = 1
# Packages whose nn.Module classes a pruned-model file may name without the caller's say-so.
DEFAULT_TRUSTED_MODULES: tuple[str, ...] = ("torch.nn", "models.zoo")


class NotAPrunedModelError(ModelError):
    """A readable checkpoint that :func:`save_pruned` did not write (another pickled object)."""


class UntrustedClassError(ModelError):
    """A pruned-model file names a class outside the trusted packages (``found``)."""


def save_pruned(model: nn.Module, path: Path | str) -> None:
    """Write ``model`` (the whole module) to ``path`` atomically.

    The model's class must be importable by name (defined at module level), as loading
    resolves it by name.

    Raises:
        ModelError: The model cannot be serialised (for example a class defined in a function).
    """
    path = Path(path)
    model_class = type(model)
    payload: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "torch_pruning_version": getattr(tp, "__version__", "unknown"),
        "model_class": f"{model_class.__module__}:{model_class.__qualname__}",
        "conv_widths": {name: list(widths) for name, widths in conv_widths(model).items()},
        "model": model,
    }
    try:
        with atomic_output_file(path) as temporary:
            torch.save(payload, temporary)
    except (AttributeError, TypeError, pickle.PicklingError) as exc:
        raise ModelError(f"cannot save the pruned model: {exc}", path=path) from exc


def load_pruned(path: Path | str, *, trusted_modules: Sequence[str] = ()) -> nn.Module:
    """Read a model written by :func:`save_pruned`; it is returned on the CPU in eval mode.

    Args:
        path: The file.
        trusted_modules: Packages or modules (``"mypackage.nets"``) whose ``nn.Module`` classes
            the file may use, in addition to :data:`DEFAULT_TRUSTED_MODULES`.

    Raises:
        ModelError: The file is missing, unreadable or not a pruned model, or it names a class
            that is not an ``nn.Module`` of a trusted package.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError("pruned model file not found", path=path)
    if isinstance(trusted_modules, str):  # one package given without a tuple
        trusted_modules = (trusted_modules,)
    trusted = tuple(DEFAULT_TRUSTED_MODULES) + tuple(trusted_modules)
    try:
        referenced = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # torch raises many types for files that are not checkpoints
        raise ModelError(f"cannot read pruned model file: {exc}", path=path) from exc
    allowed: list[Any] = [_resolve_trusted_class(name, trusted, path) for name in referenced]
    try:
        with torch.serialization.safe_globals(allowed):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated archives raise many types
        raise ModelError(f"cannot read pruned model file: {exc}", path=path) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise NotAPrunedModelError("file is not a pruned model written by save_pruned", path=path)
    version = payload.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ModelError(
            "pruned model file has an unsupported format version",
            path=path,
            expected=f"<= {FORMAT_VERSION}",
            found=version,
        )
    model = payload.get("model")
    if not isinstance(model, nn.Module):
        raise ModelError("pruned model file holds no model", path=path)
    return model.eval()


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# Modules may keep an activation function as an attribute (``self.act = F.relu``, as
# nn.TransformerEncoderLayer does): torch's functional operations are allowed as well as classes,
# whether written in Python (torch.nn.functional) or in C (torch._C._nn: gelu, hardtanh, ...).
_FUNCTION_MODULES = ("torch.nn.functional", "torch._C._nn")


def _resolve_trusted_class(name: str, trusted: Sequence[str], path: Path) -> Any:
    """Import the class ``name`` ("package.module.Class") if a trusted package holds it (or one
    of torch's functional operations)."""
    parts = name.split(".")
    # The pickle names module and attribute joined by a dot; try the longest module path first,
    # and import only module paths inside a trusted package.
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        if module_name in _FUNCTION_MODULES and split == len(parts) - 1:
            function = getattr(importlib.import_module(module_name), parts[-1], None)
            if callable(function) and not isinstance(function, type):
                return function
        if not any(_is_under(module_name, package) for package in trusted):
            continue
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                target = getattr(target, attribute)
        except AttributeError:
            continue
        if isinstance(target, type) and issubclass(target, nn.Module):
            return target
        break
    raise UntrustedClassError(
        "pruned model file refers to a class that is not a trusted nn.Module (or a function "
        "that is not one of torch's functional operations); pass its package in trusted_modules "
        "if you trust this file",
        path=path,
        found=name,
        trusted=", ".join(trusted),
    )
