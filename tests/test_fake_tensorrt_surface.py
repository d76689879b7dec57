"""The fake TensorRT exposes only what the real one has, spelled as the real one spells it.

Every public class, method, property and enum member of the 10.x fake must exist in the
``tensorrt-stubs`` package (10.13), and methods must take the same parameter names. The second
half checks the fake's strictness: what fails on a board must fail in the fake.
"""

from __future__ import annotations

import ast
import inspect
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnx")

from tests.fakes.fake_tensorrt import make_fake_tensorrt, state_of  # noqa: E402
from tests.fakes.onnx_models import qdq_conv_model  # noqa: E402
from tests.fakes.trt_stubs import repaired_stubs_or_skip  # noqa: E402

# Surface that only the 8.x flavours have (gone in 10.x, hence absent from the 10.13 stubs).
ONLY_IN_8_X = {
    "BuilderFlag.STRICT_TYPES",
    "BuilderFlag.ENABLE_TACTIC_HEURISTIC",
    "NetworkDefinitionCreationFlag.EXPLICIT_PRECISION",
}


@dataclass
class StubClass:
    methods: dict[str, list[list[str]]] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)
    settable: set[str] = field(default_factory=set)
    attributes: set[str] = field(default_factory=set)
    # pybind11-stubgen renders some enum properties (ErrorCode.name) as ``staticmethod(*args)``.
    static_methods: set[str] = field(default_factory=set)
    nested: dict[str, StubClass] = field(default_factory=dict)


@dataclass
class StubModule:
    classes: dict[str, StubClass]
    functions: dict[str, list[list[str]]]
    variables: set[str]


def _parameters(function: ast.FunctionDef, *, is_method: bool) -> list[str]:
    arguments = function.args
    names = [arg.arg for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in function.decorator_list)
    return names[1:] if is_method and not static else names


def _stub_class(node: ast.ClassDef) -> StubClass:
    stub = StubClass()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            decorators = [ast.unparse(d) for d in item.decorator_list]
            if "property" in decorators:
                stub.properties.add(item.name)
            elif any(d.endswith(".setter") for d in decorators):
                stub.settable.add(item.name)
            else:
                stub.methods.setdefault(item.name, []).append(_parameters(item, is_method=True))
                if "staticmethod" in decorators:
                    stub.static_methods.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            stub.attributes.add(item.target.id)
            # A plain annotated attribute is read-write in pybind11 (def_readwrite); ClassVar are
            # enum members.
            if "ClassVar" not in ast.unparse(item.annotation):
                stub.settable.add(item.target.id)
        elif isinstance(item, ast.ClassDef):
            stub.nested[item.name] = _stub_class(item)
    return stub


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> StubModule:
    root = repaired_stubs_or_skip(tmp_path_factory.mktemp("trt-stubs"))
    bindings = ast.parse((root / "tensorrt_bindings" / "tensorrt.pyi").read_text(encoding="utf-8"))
    package = ast.parse((root / "tensorrt" / "__init__.pyi").read_text(encoding="utf-8"))
    classes: dict[str, StubClass] = {}
    functions: dict[str, list[list[str]]] = {}
    variables: set[str] = set()
    for tree in (bindings, package):
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = _stub_class(node)
            elif isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, []).append(_parameters(node, is_method=False))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                variables.add(node.target.id)
    return StubModule(classes=classes, functions=functions, variables=variables)


def _signature_matches(function: Any, overloads: list[list[str]], *, is_method: bool) -> bool:
    parameters = list(inspect.signature(function).parameters.values())
    if is_method:
        parameters = parameters[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return False
    names = [p.name for p in parameters]
    if names in overloads:
        return True
    # One fake signature may stand for several overloads when the extra parameters have defaults
    # (Dims(), Dims(shape)).
    union: list[str] = []
    for overload in overloads:
        union += [name for name in overload if name not in union]
    in_every = set.intersection(*(set(overload) for overload in overloads)) if overloads else set()
    defaults = {p.name for p in parameters if p.default is not p.empty}
    return names == union and set(union) - in_every <= defaults


def _class_members(cls: type) -> dict[str, Any]:
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ == "builtins":
            continue
        members.update(vars(klass))
    return {
        name: value for name, value in members.items() if not name.startswith("_") or name == "__init__"
    }


def _surface_problems(fake_cls: type, stub: StubClass, label: str) -> list[str]:
    problems = []
    for name, member in _class_members(fake_cls).items():
        where = f"{label}.{name}"
        if name == "__init__":
            if getattr(member, "no_constructor", False):
                if "__init__" in stub.methods:
                    problems.append(f"{where}: the real class has a constructor")
            elif "__init__" not in stub.methods:
                problems.append(f"{where}: the real class has no constructor")
            elif not _signature_matches(member, stub.methods["__init__"], is_method=True):
                problems.append(
                    f"{where}: parameters {list(inspect.signature(member).parameters)} "
                    f"differ from {stub.methods['__init__']}"
                )
        elif isinstance(member, property):
            if name not in stub.properties | stub.attributes | stub.static_methods:
                problems.append(f"{where}: no such property")
            elif member.fset is not None and name not in stub.settable:
                problems.append(f"{where}: read-only in TensorRT")
        elif isinstance(member, types.MemberDescriptorType):
            if name not in stub.settable:
                problems.append(f"{where}: no such read-write attribute")
        elif inspect.isfunction(member):
            if name not in stub.methods:
                problems.append(f"{where}: no such method")
            elif not _signature_matches(member, stub.methods[name], is_method=True):
                problems.append(
                    f"{where}: parameters {list(inspect.signature(member).parameters)[1:]} "
                    f"differ from {stub.methods[name]}"
                )
        elif isinstance(member, type):
            if name not in stub.nested:
                problems.append(f"{where}: no such nested class")
            else:
                problems += _surface_problems(member, stub.nested[name], where)
        elif name not in stub.attributes:
            problems.append(f"{where}: no such attribute or enum member")
    return problems


def _public(module: types.ModuleType) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") or name == "__version__"
    }


def test_fake_10x_surface_exists_in_the_stubs(stubs: StubModule) -> None:
    fake = make_fake_tensorrt("10.3.0")
    problems: list[str] = []
    for name, value in _public(fake).items():
        if isinstance(value, type):
            if name not in stubs.classes:
                problems.append(f"{name}: no such class")
            else:
                problems += _surface_problems(value, stubs.classes[name], name)
        elif inspect.isfunction(value):
            if name not in stubs.functions:
                problems.append(f"{name}: no such function")
            elif not _signature_matches(value, stubs.functions[name], is_method=False):
                problems.append(f"{name}: parameters differ from {stubs.functions[name]}")
        elif name not in stubs.variables:
            problems.append(f"{name}: no such module attribute")
    assert problems == []


def test_the_surface_check_catches_a_wrong_parameter_name(stubs: StubModule) -> None:
    class IBuilderConfig:
        def set_memory_pool_limit(self, pool_type: Any, size: int) -> None:
            """Misnamed parameters (TensorRT's are ``pool`` and ``pool_size``)."""

        def set_max_workspace_size(self, size: int) -> None:
            """Gone in TensorRT 10."""

    problems = _surface_problems(IBuilderConfig, stubs.classes["IBuilderConfig"], "IBuilderConfig")
    assert len(problems) == 2


def _surface_names(module: types.ModuleType) -> set[str]:
    names = set()
    for name, value in _public(module).items():
        names.add(name)
        if isinstance(value, type):
            names |= {f"{name}.{member}" for member in _class_members(value)}
    return names


@pytest.mark.parametrize("version", ("8.5.2.2", "8.6.1.6", "11.0.0.11"))
def test_other_flavours_add_nothing_beyond_known_version_differences(version: str) -> None:
    extra = _surface_names(make_fake_tensorrt(version)) - _surface_names(make_fake_tensorrt("10.3.0"))
    allowed = ONLY_IN_8_X | {"INetworkDefinition.has_implicit_batch_dimension"}
    assert extra <= allowed


# --- strictness --------------------------------------------------------------------------------------


def _parsed_network(trt: Any, model: Path, flags: int = 0) -> tuple[Any, Any, Any]:
    logger = trt.Logger()
    builder = trt.Builder(logger)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    return builder, network, parser.parse(model.read_bytes(), str(model))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return qdq_conv_model(tmp_path / "model.onnx")


def test_unknown_attributes_are_rejected(model: Path) -> None:
    trt = make_fake_tensorrt("10.3.0")
    builder, network, _ = _parsed_network(trt, model)
    config = builder.create_builder_config()
    with pytest.raises(AttributeError):
        config.max_workspace_size = 1 << 30  # removed in TensorRT 10
    with pytest.raises(AttributeError):
        network.get_layer(0).precison = trt.float16  # a typo must not pass silently
    with pytest.raises(AttributeError):
        builder.max_batch_size  # noqa: B018 - implicit batch is gone in 10


def test_classes_without_a_constructor_cannot_be_made() -> None:
    trt = make_fake_tensorrt("10.3.0")
    for name in ("ILayer", "ITensor", "INetworkDefinition", "IBuilderConfig", "IHostMemory", "ParserError"):
        with pytest.raises(TypeError):
            getattr(trt, name)()


def test_arguments_are_type_checked(model: Path) -> None:
    trt = make_fake_tensorrt("10.3.0")
    builder, network, _ = _parsed_network(trt, model)
    config = builder.create_builder_config()
    with pytest.raises(TypeError):
        config.set_flag(int(trt.BuilderFlag.INT8))
    with pytest.raises(TypeError):
        config.set_memory_pool_limit(pool=trt.MemoryPoolType.WORKSPACE, size=1)
    with pytest.raises(TypeError):
        network.get_layer(0).precision = "fp16"


def test_logger_subclass_must_call_the_base_constructor() -> None:
    trt = make_fake_tensorrt("10.3.0")

    class Forgetful(trt.ILogger):  # type: ignore[name-defined]
        def __init__(self) -> None:
            pass

        def log(self, severity: Any, msg: str) -> None:
            pass

    with pytest.raises(TypeError):
        trt.Builder(Forgetful())


def test_progress_monitor_is_checked_like_tensorrts(model: Path) -> None:
    trt = make_fake_tensorrt("10.3.0")
    config = trt.Builder(trt.Logger()).create_builder_config()

    class Forgetful(trt.IProgressMonitor):  # type: ignore[name-defined]
        def __init__(self) -> None:
            pass

    with pytest.raises(TypeError):
        config.progress_monitor = Forgetful()
    with pytest.raises(TypeError):
        config.progress_monitor = lambda *args: True
    # An interface method left abstract fails when TensorRT calls it.
    with pytest.raises(RuntimeError):
        trt.IProgressMonitor().step_complete("phase", 0)


def test_8x_parser_needs_an_explicit_batch_network(model: Path) -> None:
    trt = make_fake_tensorrt("8.5.2.2")
    _, network, parsed = _parsed_network(trt, model, flags=0)
    assert parsed is False
    _, network, parsed = _parsed_network(
        trt, model, flags=1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    )
    assert parsed is True
    assert network.num_layers == 6


def test_8_5_lacks_the_newer_apis(model: Path) -> None:
    trt = make_fake_tensorrt("8.5.2.2")
    config = trt.Builder(trt.Logger()).create_builder_config()
    with pytest.raises(AttributeError):
        config.builder_optimization_level = 3
    assert not hasattr(trt, "IProgressMonitor")
    assert not hasattr(make_fake_tensorrt("8.6.1.6").IBuilderConfig, "progress_monitor")
    with pytest.raises(AttributeError):
        config.progress_monitor = None
    assert not hasattr(trt.ParserError, "node_name")
    assert hasattr(make_fake_tensorrt("8.6.1.6").IBuilderConfig, "builder_optimization_level")


def test_11x_has_no_weak_typing(model: Path) -> None:
    trt = make_fake_tensorrt("11.0.0")
    for flag in ("INT8", "FP16", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"):
        assert not hasattr(trt.BuilderFlag, flag)
    _, network, parsed = _parsed_network(trt, model)
    assert parsed
    with pytest.raises(AttributeError):
        network.get_layer(0).precision = trt.float16
    with pytest.raises(AttributeError):
        network.get_layer(0).set_output_type(0, trt.float16)


def test_set_shape_validates_like_tensorrt() -> None:
    trt = make_fake_tensorrt("10.3.0")
    profile = trt.Builder(trt.Logger()).create_optimization_profile()
    with pytest.raises(RuntimeError):
        profile.set_shape("images", (1, 3, 64, 64), (4, 3, 32, 32), (8, 3, 64, 64))  # opt < min
    with pytest.raises(RuntimeError):
        profile.set_shape("images", (1, 3, 64, 64), (4, 3, 64), (8, 3, 64, 64))  # rank
    with pytest.raises(RuntimeError):
        profile.set_shape("images", (-1, 3, 64, 64), (4, 3, 64, 64), (8, 3, 64, 64))
    profile.set_shape("images", trt.Dims([1, 3, 64, 64]), [4, 3, 64, 64], (8, 3, 64, 64))
    assert [list(dims) for dims in profile.get_shape("images")] == [
        [1, 3, 64, 64],
        [4, 3, 64, 64],
        [8, 3, 64, 64],
    ]


def test_build_checks_the_profile_against_the_network(model: Path) -> None:
    trt = make_fake_tensorrt("10.3.0")
    builder, network, _ = _parsed_network(trt, model)
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.INT8)
    assert builder.build_serialized_network(network, config) is None  # dynamic input, no profile
    profile = builder.create_optimization_profile()
    profile.set_shape("images", (1, 4, 32, 32), (1, 4, 32, 32), (1, 4, 32, 32))  # C is 3 in the model
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is None
    assert state_of(trt).builds == []


def test_parser_names_layers_like_onnx_tensorrt(tmp_path: Path) -> None:
    import onnx

    trt = make_fake_tensorrt("10.3.0")
    model = onnx.load(str(qdq_conv_model(tmp_path / "m.onnx")))
    model.graph.node[4].name = ""  # relu0 unnamed
    model.graph.node[5].name = "conv0"  # conv1 clashes with conv0
    path = tmp_path / "renamed.onnx"
    onnx.save(model, str(path))
    _, network, parsed = _parsed_network(trt, path)
    assert parsed
    names = [network.get_layer(i).name for i in range(network.num_layers)]
    assert names[3:] == ["conv0", "node_of_relu0_out", "conv0_0"]
