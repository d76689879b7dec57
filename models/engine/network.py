"""The network from the bundle's ONNX model: read, parsed by TensorRT's ONNX parser (with errors
that name the failing nodes), and the FP16 fallback layers set (8.5, 10.x) or checked (11.x).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import EngineError
from models.engine.features import TensorRTFeatures
from models.engine.logs import LogCapture

if TYPE_CHECKING:
    import tensorrt as trt


def read_onnx(onnx_path: Path) -> bytes:
    try:
        data = Path(onnx_path).read_bytes()
    except FileNotFoundError:
        raise EngineError("ONNX model not found", path=onnx_path) from None
    except IsADirectoryError:
        raise EngineError("ONNX model path is a directory", path=onnx_path) from None
    except OSError as exc:
        raise EngineError(
            "cannot read the ONNX model", path=onnx_path, reason=exc.strerror or str(exc)
        ) from None
    if not data:
        raise EngineError("ONNX model file is empty", path=onnx_path)
    return data


def parse_onnx(
    builder: trt.Builder,
    logger: trt.ILogger,
    data: bytes,
    onnx_path: Path,
    features: TensorRTFeatures,
    capture: LogCapture,
) -> tuple[trt.INetworkDefinition, trt.OnnxParser]:
    """The network TensorRT's ONNX parser makes of ``data`` (the bytes of ``onnx_path``).

    The parser comes back with the network: the network's weights belong to the parser, so the
    caller keeps it referenced until the engine is built.
    """
    import tensorrt as trt

    flags = 0
    if features.needs_explicit_batch:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(data, str(onnx_path)):
        raise EngineError(
            "TensorRT's ONNX parser rejected the model",
            path=onnx_path,
            errors=_parse_errors(parser, data) or capture.of("ERROR", "INTERNAL_ERROR"),
        )
    return network, parser


def network_inputs(network: trt.INetworkDefinition) -> dict[str, list[int]]:
    """Each input's shape as the network reports it, with -1 for dynamic axes."""
    inputs: dict[str, list[int]] = {}
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        if tensor.is_shape_tensor:
            raise EngineError("shape-tensor inputs are not supported", input=tensor.name)
        inputs[tensor.name] = _dims(tensor.shape)
    return inputs


def _dims(dims: trt.Dims) -> list[int]:
    # Dims supports len() and indexing; the stubs declare no __iter__.
    return [dims[index] for index in range(len(dims))]


def _onnx_node_names(model: bytes) -> list[str] | None:
    """Node names by index, for parsers (8.x) whose errors carry only the index. Best effort."""
    try:
        import onnx
    except ImportError:
        return None
    try:
        graph = onnx.load_model_from_string(model).graph
    except Exception:  # noqa: BLE001 - a model TensorRT could not parse may not load here either
        return None
    return [node.name for node in graph.node]


def _parse_errors(parser: trt.OnnxParser, model: bytes) -> list[str]:
    node_names: list[str] | None = None
    described: list[str] = []
    for index in range(parser.num_errors):
        error: trt.ParserError = parser.get_error(index)
        node = error.node()
        where = ""
        if node >= 0:
            # node_name()/node_operator() exist from TensorRT 10 on; 8.x errors carry the index only.
            if hasattr(error, "node_name"):
                name, operator = error.node_name(), error.node_operator()
            else:
                if node_names is None:
                    node_names = _onnx_node_names(model) or []
                name = node_names[node] if node < len(node_names) else ""
                operator = ""
            where = (
                f"node {node}"
                + (f" '{name}'" if name else "")
                + (f" ({operator})" if operator else "")
                + ": "
            )
        # str() of a pybind11 enum reads "ErrorCode.UNSUPPORTED_NODE"; keep the member name.
        code = str(error.code()).rsplit(".", 1)[-1]
        described.append(f"{where}{code}: {error.desc()}")
    return described


def _layers_by_name(network: trt.INetworkDefinition) -> dict[str, trt.ILayer]:
    return {layer.name: layer for layer in (network.get_layer(i) for i in range(network.num_layers))}


def _fp16_layers(network: trt.INetworkDefinition, names: Sequence[str]) -> list[trt.ILayer]:
    """The layers for the ONNX nodes in ``names``.

    Assumption (read in onnx-tensorrt's ``ImporterContext::registerLayer`` and ``getNodeName``,
    not verified on a board): the parser names the main layer of each node after the ONNX node
    name (``node_of_<first output>`` for an unnamed node), uniquified with a ``_<n>`` suffix only
    on a clash; helper layers a node may add get other names. Only exact matches are used, so a
    helper layer of a fallback node is left to TensorRT's choice.
    """
    layers = _layers_by_name(network)
    missing = [name for name in names if name not in layers]
    if missing:
        raise EngineError(
            "FP16 fallback layers not found among the parsed network's layers",
            missing=missing,
            layers=sorted(layers)[:20],
        )
    return [layers[name] for name in names]


def apply_fp16_fallback(network: trt.INetworkDefinition, names: Sequence[str]) -> None:
    import tensorrt as trt

    for layer in _fp16_layers(network, names):
        layer.precision = trt.float16
        for index in range(layer.num_outputs):
            # Only float outputs take a float16 output type; a shape or index output must not.
            if layer.get_output(index).dtype in (trt.float32, trt.float16):
                layer.set_output_type(index, trt.float16)


def check_fp16_in_graph(network: trt.INetworkDefinition, names: Sequence[str]) -> None:
    """On strongly typed networks (11.x) the fallback layers must already compute in FP16.

    Assumption: in a strongly typed network the tensor types are inferred while the network is
    built, so ``ITensor.dtype`` already reports the graph's type before the engine is built.
    """
    import tensorrt as trt

    not_fp16 = []
    for layer in _fp16_layers(network, names):
        dtypes = [layer.get_output(index).dtype for index in range(layer.num_outputs)]
        if not any(dtype == trt.float16 for dtype in dtypes):
            not_fp16.append(f"{layer.name} ({', '.join(dtype.name for dtype in dtypes)})")
    if not_fp16:
        raise EngineError(
            "TensorRT 11 builds strongly typed networks: the FP16 fallback layers must already be "
            "FP16 in the ONNX (convert it on the host, e.g. ModelOpt AutoCast with these nodes, "
            "before bundling)",
            layers=not_fp16,
        )
