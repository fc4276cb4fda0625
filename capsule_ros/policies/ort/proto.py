"""ONNX's protobuf messages (``ModelProto``...) without the ``onnx`` package's import.

``import onnx`` imports its helpers, which import ``ml_dtypes`` (a C extension registering
numpy dtypes): seconds of a small ONNX policy's start-up on a loaded machine, beyond
torch's own import (docs/benchmarks.md, "Start-up (capsule-ros bench startup)"). The
kind only parses a model and reads fields of its graph, which the generated protobuf module
``onnx/onnx_ml_pb2.py`` alone can do: it is loaded from the installed ``onnx`` package's
directory without running the package's ``__init__`` (it imports only ``google.protobuf``,
and registers the same file descriptor ``onnx`` itself registers, so a later ``import
onnx`` in the process works and shares its message types). Where that module is not
found (another layout of a future ``onnx``), ``import onnx`` is used as before.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXTERNAL = 1          # TensorProto.DataLocation.EXTERNAL
MODULE = "capsule_ros.policies.ort._onnx_ml_pb2"      # its name in sys.modules once loaded


def _pb2() -> Any:
    """The generated module (loaded once per process, as any import), or ``onnx``."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    spec = importlib.util.find_spec("onnx")
    path = Path(spec.origin).with_name("onnx_ml_pb2.py") if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        import onnx
        return onnx
    module_spec = importlib.util.spec_from_file_location(MODULE, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules[MODULE] = module
    return module


def parse_model(data: bytes) -> Any:
    """An ``onnx.ModelProto`` parsed from ``data`` (a model file's bytes; its external data
    is not loaded), as ``onnx.load_model_from_string`` parses it. Raises what protobuf
    raises for bytes that are not a model (a ``DecodeError``)."""
    proto = _pb2().ModelProto()
    decoded = proto.ParseFromString(data)
    if decoded is not None and decoded != len(data):
        from google.protobuf.message import DecodeError
        raise DecodeError(f"Protobuf decoding consumed too few bytes: {decoded} out of {len(data)}")
    return proto


def external_location(tensor: Any) -> str:
    """The external data file an initializer names ('' when its data is in the model):
    ``onnx.external_data_helper``'s ``uses_external_data`` and ``ExternalDataInfo.location``."""
    if not tensor.HasField("data_location") or tensor.data_location != EXTERNAL:
        return ""
    return next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
