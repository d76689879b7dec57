"""Repaired copies of the ``tensorrt-stubs`` type stubs, so that ``ast`` and mypy can read them.

TensorRT itself cannot be installed on a developer machine, so the engine builder is type-checked
against the community stub package ``tensorrt-stubs`` (generated from the 10.13 pybind11 module).
The generated ``.pyi`` files are not quite valid Python, and a few generated names hide builtins.
:func:`repaired_stubs` copies them to a folder of your choice with the smallest edits that fix that:

1. A parameter named ``in`` (a keyword) in the plugin interfaces becomes ``in_``.
2. ``INetworkDefinition.add_scale_nd`` lists ``channel_axis`` (no default) after parameters with
   defaults; such parameters become keyword-only (a ``*,`` is inserted before the first of them),
   which keeps them required.
3. The module-level ``bool: DataType`` (TensorRT's ``trt.bool``) shadows the builtin in every
   annotation of ``tensorrt_bindings/tensorrt.pyi``, so mypy rejects ``-> bool`` and treats it as
   ``Any``; annotations are rewritten to ``builtins.bool``.
4. ``typing_extensions.Buffer`` is used without ``import typing_extensions``; the import is added so
   that ``OnnxParser.parse`` and ``IBuilderConfig.create_timing_cache`` are really checked.

Other defects (pybind11's ``...`` for types it could not name, ``capsule``, plugin ``self`` types,
implicit ``Optional`` defaults) are left as they are: they only turn a type into ``Any`` and sit in
APIs this project does not use. :func:`write_mypy_config` writes a mypy configuration that keeps the
project's ``[tool.mypy]`` settings, points ``mypy_path`` at the stubs and silences errors *inside*
the stub modules (``follow_imports = silent`` needs ``follow_imports_for_stubs`` to reach ``.pyi``
files); errors in our code that calls them are still reported.

Usage::

    python tools/trt_stubs.py DEST
    python -m mypy --config-file DEST/mypy.ini models/engine
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6): the project depends on tomli there.
    import tomli as tomllib

DISTRIBUTION = "tensorrt-stubs"
PINNED_VERSION = "10.13.0.35.1"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={PINNED_VERSION}"

# The stub files this tool repairs, relative to site-packages.
STUB_FILES = (
    "tensorrt/__init__.pyi",
    "tensorrt_bindings/__init__.pyi",
    "tensorrt_bindings/tensorrt.pyi",
)


class StubsError(RuntimeError):
    """The stub distribution is missing, or its files cannot be repaired into valid Python."""


def installed_stub_files() -> dict[str, Path]:
    """Locate the installed ``tensorrt-stubs`` files, keyed by their path inside site-packages.

    Raises:
        StubsError: if the distribution is not installed or lacks one of :data:`STUB_FILES`.
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise StubsError(
            f"the '{DISTRIBUTION}' distribution is not installed; run: {INSTALL_HINT}"
        ) from None
    located: dict[str, Path] = {}
    for entry in dist.files or ():
        if entry.as_posix() in STUB_FILES:
            located[entry.as_posix()] = Path(str(dist.locate_file(entry)))
    missing = [name for name in STUB_FILES if name not in located or not located[name].is_file()]
    if missing:
        raise StubsError(
            f"'{DISTRIBUTION}' {dist.version} lacks {', '.join(missing)}; reinstall it with: {INSTALL_HINT}"
        )
    return located


_DEF_LINE = re.compile(r"^(?P<head>\s*def \w+\()(?P<params>.*)(?P<tail>\)\s*(->.*)?:\s*)$")


def _split_top_level(params: str) -> list[str]:
    """Split a parameter list at the commas that are not nested in brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in params:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def _repair_parameters(params: str) -> str:
    parts = _split_top_level(params)
    repaired: list[str] = []
    seen_default = False
    keyword_only = False
    for part in parts:
        name = part.strip().split(":", 1)[0].split("=", 1)[0].strip()
        if name == "in":
            part = part.replace("in", "in_", 1)
        if name in ("*", "/") or name.startswith("*"):
            keyword_only = keyword_only or name.startswith("*")
            repaired.append(part)
            continue
        has_default = "=" in part
        if has_default:
            seen_default = True
        elif seen_default and not keyword_only:
            repaired.append(" *")
            keyword_only = True
        repaired.append(part)
    return ",".join(repaired)


_BOOL_WORD = re.compile(r"(?<![\w.'\"])bool(?![\w'\"])")


def repair_source(text: str, *, shadowed_bool: bool) -> str:
    """Return ``text`` with the repairs described in this module's docstring applied."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    in_docstring = False
    for line in lines:
        stripped = line.strip()
        # Docstrings in the stubs are triple-quoted blocks; their prose must stay untouched.
        if in_docstring:
            out.append(line)
            if stripped.count('"""') % 2 == 1:
                in_docstring = False
            continue
        if stripped.startswith('"""'):
            if stripped.count('"""') % 2 == 1:
                in_docstring = True
            out.append(line)
            continue
        body = line.rstrip("\r\n")
        ending = line[len(body) :]
        match = _DEF_LINE.match(body)
        if match:
            params = _repair_parameters(match.group("params"))
            tail = match.group("tail")
            if shadowed_bool:
                params = _BOOL_WORD.sub("builtins.bool", params)
                tail = _BOOL_WORD.sub("builtins.bool", tail)
            out.append(f"{match.group('head')}{params}{tail}{ending}")
            continue
        if shadowed_bool and line.startswith((" ", "\t")) and re.match(r"^\s+\w+\s*:", line):
            name, _, annotation = line.partition(":")
            out.append(f"{name}:{_BOOL_WORD.sub('builtins.bool', annotation)}")
            continue
        out.append(line)
    repaired = "".join(out)
    imports: list[str] = []
    if shadowed_bool and not re.search(r"^import builtins$", repaired, re.M):
        imports.append("import builtins")
    if "typing_extensions." in repaired and not re.search(r"^import typing_extensions$", repaired, re.M):
        imports.append("import typing_extensions")
    if imports:
        # After ``from __future__ import annotations``, which must stay the first statement; the
        # files use CRLF line ends, kept as they are so that a diff shows only the repairs.
        newline = "\r\n" if "\r\n" in repaired else "\n"
        future = re.search(r"^from __future__ import [^\n]*\n", repaired, re.M)
        at = future.end() if future else 0
        repaired = repaired[:at] + "".join(f"{line}{newline}" for line in imports) + repaired[at:]
    return repaired


def _shadows_bool(text: str) -> bool:
    return re.search(r"^bool\s*:", text, re.M) is not None


def repaired_stubs(dest: Path) -> Path:
    """Copy the installed TensorRT stubs to ``dest`` with the minimal repairs, and check them.

    Args:
        dest: Folder to write into (created if needed); use it as ``MYPYPATH``.

    Returns:
        ``dest``, which then holds ``tensorrt/__init__.pyi`` and ``tensorrt_bindings/*.pyi``.

    Raises:
        StubsError: if ``tensorrt-stubs`` is not installed, or a repaired file still fails to parse.
    """
    dest = Path(dest)
    for relative, source in installed_stub_files().items():
        with open(source, encoding="utf-8", newline="") as handle:
            text = handle.read()
        # Only the bindings module annotates with ``bool``; the package __init__ files merely
        # re-export, so their own ``bool: DataType`` line needs no rewrite.
        repaired = repair_source(text, shadowed_bool=relative.endswith("tensorrt_bindings/tensorrt.pyi"))
        try:
            ast.parse(repaired, filename=relative)
        except SyntaxError as exc:
            raise StubsError(
                f"{relative} still does not parse after repair (line {exc.lineno}: {exc.msg}); "
                f"the installed '{DISTRIBUTION}' may differ from {PINNED_VERSION}"
            ) from None
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8", newline="") as handle:
            handle.write(repaired)
    return dest


# Modules whose own errors mypy must not report: the stubs, and the runtime-library package that
# the stub ``__init__`` files import but that has no stubs.
STUB_MODULES = ("tensorrt", "tensorrt.*", "tensorrt_bindings", "tensorrt_bindings.*", "tensorrt_libs")


def _ini_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def write_mypy_config(stubs_dir: Path, *, project_root: Path | None = None) -> Path:
    """Write ``stubs_dir/mypy.ini`` for type-checking code that imports ``tensorrt``.

    Args:
        stubs_dir: Folder returned by :func:`repaired_stubs`; becomes ``mypy_path``.
        project_root: Folder whose ``pyproject.toml`` ``[tool.mypy]`` settings (and per-module
            overrides) are carried over; ``None`` writes only the stub settings.

    Returns:
        The path of the written configuration, for ``mypy --config-file``.
    """
    stubs_dir = Path(stubs_dir).resolve()
    settings: dict[str, Any] = {}
    overrides: list[dict[str, Any]] = []
    if project_root is not None:
        pyproject = Path(project_root) / "pyproject.toml"
        if pyproject.is_file():
            with open(pyproject, "rb") as handle:
                mypy_table = dict(tomllib.load(handle).get("tool", {}).get("mypy", {}))
            overrides = list(mypy_table.pop("overrides", []))
            settings.update(mypy_table)
    settings["mypy_path"] = str(stubs_dir)
    lines = ["[mypy]"]
    lines += [f"{key} = {_ini_value(value)}" for key, value in settings.items()]
    for override in overrides:
        modules = override.get("module", [])
        modules = [modules] if isinstance(modules, str) else list(modules)
        lines += ["", f"[mypy-{','.join(modules)}]"]
        lines += [f"{key} = {_ini_value(value)}" for key, value in override.items() if key != "module"]
    lines += [
        "",
        f"[mypy-{','.join(STUB_MODULES)}]",
        "follow_imports = silent",
        "follow_imports_for_stubs = True",
        "ignore_missing_imports = True",
    ]
    config = stubs_dir / "mypy.ini"
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("dest", type=Path, help="folder to write the repaired stubs into")
    parser.add_argument(
        "--project-root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="project whose [tool.mypy] settings go into DEST/mypy.ini (default: this checkout)",
    )
    args = parser.parse_args(argv)
    try:
        out = repaired_stubs(args.dest)
    except StubsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    config = write_mypy_config(out, project_root=args.project_root)
    print(f"repaired TensorRT stubs written to {out}")
    print(f"type-check with: python -m mypy --config-file {config} models/engine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
