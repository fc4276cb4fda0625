"""An ONNX model file as ``policy.kind: onnx`` reads it, before any session exists.

``read_model`` opens the file with the ``onnx`` package (external data files beside it
included) and returns an ``OnnxModel``: the graph, the digest of every byte ONNX Runtime
will read (the model file, then each external data file it names, in order; a moved
file keeps its digest, a changed weight does not), the inputs and outputs with their
shapes made concrete, and the control-flow nodes a CUDA graph cannot take.

Shapes. Every input and output is bound to a fixed-size arena buffer, so each dimension
must be known before serving: a number in the model, or a named (symbolic) dimension
given a value in ``policy.onnx.dims`` (``'batch=1'``; ONNX Runtime is told the same
values as free-dimension overrides, so its graph is static too). A dimension left open
is refused with the tensor and the dimension it concerns.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Tuple

import torch

from capsule_ros.errors import ConfigError

CONTROL_FLOW = ("If", "Loop", "Scan")
# ONNX TensorProto element types the arena can hold
ELEMENT_TYPES: Dict[int, torch.dtype] = {1: torch.float32, 2: torch.uint8, 6: torch.int32, 7: torch.int64,
                                         10: torch.float16, 11: torch.float64}


class OnnxModelError(ConfigError):
    """An ONNX model that cannot be served; the message names the file and what to change."""


@dataclass(frozen=True)
class TensorInfo:
    """One graph input or output: its name, element type and concrete shape."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{self.name} {str(self.dtype).replace('torch.', '')}{list(self.shape)}"


@dataclass(frozen=True)
class OnnxModel:
    """What ``read_model`` found (see the module docstring)."""

    path: Path
    where: str
    sha256: str
    files: Tuple[str, ...]                 # the file names the digest covers, model first
    inputs: Tuple[TensorInfo, ...]
    outputs: Tuple[TensorInfo, ...]
    control_flow: Tuple[str, ...]          # 'If node "name"' for every control-flow node, nested ones too
    opset: int
    proto: object                          # onnx.ModelProto (graph only: external data is not loaded)

    def input(self, name: str) -> TensorInfo:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorInfo:
        return next(t for t in self.outputs if t.name == name)


def _external_files(proto) -> List[str]:
    """The external data files the initializers name, in order of first use."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    seen: List[str] = []
    for tensor in _initializers(proto.graph):
        if uses_external_data(tensor):
            location = ExternalDataInfo(tensor).location
            if location not in seen:
                seen.append(location)
    return seen


def _check_external_extents(proto, sizes: Mapping[str, int], where: str) -> None:
    """Every initializer kept in an external data file lies inside that file: a truncated
    ``.data`` file (an interrupted copy) is refused naming the tensor and its bytes, before
    ONNX Runtime reads it (whose own report of it is a C++ dump)."""
    import math

    from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    from onnx.helper import tensor_dtype_to_np_dtype
    for tensor in _initializers(proto.graph):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        length = info.length
        if length is None:
            try:
                itemsize = tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            except (KeyError, TypeError, ValueError):
                continue                            # a type whose size ONNX Runtime checks itself
            length = math.prod(tensor.dims) * itemsize
        start, size = int(info.offset or 0), sizes[info.location]
        if start + int(length) > size:
            raise OnnxModelError(f"{where}: its external data file {info.location!r} is truncated: initializer "
                                 f"{tensor.name!r} is bytes {start}..{start + int(length)} of it, the file has "
                                 f"{size} (copy or export the model again)")


def onnxruntime_reason(exc: BaseException) -> str:
    """ONNX Runtime's reason for an error, in one line: the innermost of its nested
    ``[ONNXRuntimeError] : N : CODE :`` messages, without the C++ source location and
    function signature in front of it."""
    text = " ".join(str(exc).split())
    parts = [p.strip() for p in re.split(r"\[ONNXRuntimeError\] : \d+ : \w+ :", text) if p.strip()]
    reason = parts[-1] if parts else text
    reason = re.sub(r"^(?:Exception during initialization: )?(?:\S+\.(?:cc|cpp|h):\d+ \S+ )?", "", reason)
    return reason or text or type(exc).__name__


def _initializers(graph) -> Iterator:
    yield from graph.initializer
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from _initializers(sub)


def _subgraphs(node) -> Iterator:
    for attribute in node.attribute:
        if attribute.HasField("g"):
            yield attribute.g
        yield from attribute.graphs


def _control_flow(graph) -> List[str]:
    found = []
    for node in graph.node:
        if node.op_type in CONTROL_FLOW and node.domain in ("", "ai.onnx"):
            found.append(f"{node.op_type} node {node.name or node.output[0]!r}")
        for sub in _subgraphs(node):
            found += _control_flow(sub)
    return found


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _tensor(value, dims: Mapping[str, int], where: str, role: str) -> TensorInfo:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise OnnxModelError(f"{where}: {role} {value.name!r} is a {kind}, not a tensor; capsule_ros binds "
                             "tensors only")
    tensor = value.type.tensor_type
    dtype = ELEMENT_TYPES.get(tensor.elem_type)
    if dtype is None:
        raise OnnxModelError(f"{where}: {role} {value.name!r} has ONNX element type {tensor.elem_type}, which the "
                             f"arena cannot hold (it holds {sorted(_name(t) for t in ELEMENT_TYPES.values())})")
    if not tensor.HasField("shape"):
        raise OnnxModelError(f"{where}: {role} {value.name!r} has no shape in the model; export it with fixed shapes")
    shape = []
    for i, dim in enumerate(tensor.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            shape.append(int(dim.dim_value))
        elif dim.HasField("dim_param") and dim.dim_param in dims:
            shape.append(int(dims[dim.dim_param]))
        elif dim.HasField("dim_param"):
            raise OnnxModelError(
                f"{where}: {role} {value.name!r} has the dynamic dimension {dim.dim_param!r} (axis {i}); every input "
                f"and output is bound to a fixed arena buffer: give it a size with policy.onnx.dims: "
                f"['{dim.dim_param}=N'] (1 for a batch dimension), or export the model with fixed shapes")
        else:
            raise OnnxModelError(f"{where}: {role} {value.name!r} has an unknown size on axis {i}; export the model "
                                 "with fixed shapes (dynamic_axes={}) or name the dimension and set policy.onnx.dims")
    return TensorInfo(value.name, dtype, tuple(shape))


def read_model(path: Path, dims: Mapping[str, int], where: str) -> OnnxModel:
    """The model at ``path`` (see the module docstring); OnnxModelError naming ``where``."""
    import onnx
    path = Path(path).expanduser()
    if not path.is_file():
        raise OnnxModelError(f"{where}: no such file {path}")
    data = path.read_bytes()
    try:
        proto = onnx.load_model_from_string(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure: say so in one line
        raise OnnxModelError(f"{where}: not a readable ONNX model, the file is truncated or not ONNX "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    digest = hashlib.sha256()
    digest.update(f"{path.name}|{len(data)}|".encode())
    digest.update(data)
    files = [path.name]
    sizes = {}
    for location in _external_files(proto):
        external = (path.parent / location).resolve()
        if path.parent.resolve() not in external.parents or not external.is_file():
            raise OnnxModelError(f"{where}: its weights are in the external data file {location!r}, which is not a "
                                 f"file beside the model in {path.parent}")
        blob = external.read_bytes()
        digest.update(f"|{location}|{len(blob)}|".encode())
        digest.update(blob)
        files.append(location)
        sizes[location] = len(blob)
    _check_external_extents(proto, sizes, where)
    graph = proto.graph
    initialised = {t.name for t in graph.initializer}
    inputs = tuple(_tensor(v, dims, where, "input") for v in graph.input if v.name not in initialised)
    outputs = tuple(_tensor(v, dims, where, "output") for v in graph.output)
    opset = max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return OnnxModel(path, where, digest.hexdigest(), tuple(files), inputs, outputs, tuple(_control_flow(graph)),
                     int(opset), proto)


def in_place_safe(graph, state_input: str, state_output: str) -> bool:
    """Whether ONNX Runtime may write ``state_output`` into the buffer of ``state_input``:
    every node that reads the input is a strict ancestor of the node that writes the
    output, so (sequential execution runs nodes in a topological order) all reads end
    before the write begins, and the writing node does not read the input itself. A
    graph with control flow (subgraphs read outer values implicitly) never qualifies."""
    if _control_flow(graph):
        return False
    producers = {out: node for node in graph.node for out in node.output}
    writer = producers.get(state_output)
    if writer is None:
        return False                                   # the output is an input or an initializer passed through
    readers = [node for node in graph.node if state_input in node.input]
    ancestors, frontier = set(), list(writer.input)
    while frontier:
        name = frontier.pop()
        node = producers.get(name)
        if node is not None and id(node) not in ancestors:
            ancestors.add(id(node))
            frontier.extend(node.input)
    return all(id(node) in ancestors for node in readers) and id(writer) not in {id(n) for n in readers}
