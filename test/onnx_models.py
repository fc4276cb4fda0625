"""Small ONNX models for the policy.kind onnx tests, written with onnx.helper (seeded):
a recurrent cell whose state output can be written in place, a model with an If node,
one with a dynamic batch dimension, and one with an input capsule_ros cannot feed; and a
fixture's model with its state and episode-start tensors renamed."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import numpy as np

OBS, HIDDEN, ACTIONS = 48, 16, 12


def _save(path: Path, nodes, inputs, outputs, inits) -> Path:
    import onnx
    from onnx import helper
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _weights(seed: int) -> List:
    from onnx import numpy_helper
    rng = np.random.default_rng(seed)
    return [numpy_helper.from_array((rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32), n)
            for n, s in (("U", (OBS, HIDDEN)), ("W", (HIDDEN, HIDDEN)), ("V", (HIDDEN, ACTIONS)))]


def recurrent_cell(path: Path, batch: object = 1, extra_input: bool = False) -> Path:
    """h_out = 0.9 tanh(obs U + h_in W), actions = h_out V: the node writing h_out (Mul)
    does not read h_in, and the one that does (ONNX Runtime fuses MatMul, Add and Tanh
    into one FusedGemm) runs before it. ``batch``: a number, or a
    name for a dynamic dimension; ``extra_input``: an input 'goal' nothing can feed."""
    from onnx import TensorProto, helper
    nodes = [helper.make_node("MatMul", ["obs", "U"], ["a"]), helper.make_node("MatMul", ["h_in", "W"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["pre"]), helper.make_node("Tanh", ["pre"], ["squashed"]),
             helper.make_node("Mul", ["squashed", "decay"], ["h_out"]),
             helper.make_node("MatMul", ["h_out", "V"], ["actions"])]
    inputs = [helper.make_tensor_value_info("obs", TensorProto.FLOAT, [batch, OBS]),
              helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [batch, HIDDEN])]
    if extra_input:
        inputs.append(helper.make_tensor_value_info("goal", TensorProto.FLOAT, [batch, 2]))
        nodes.append(helper.make_node("Identity", ["goal"], ["echo"]))
    outputs = [helper.make_tensor_value_info("actions", TensorProto.FLOAT, [batch, ACTIONS]),
               helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [batch, HIDDEN])]
    if extra_input:
        outputs.append(helper.make_tensor_value_info("echo", TensorProto.FLOAT, [batch, 2]))
    from onnx import numpy_helper
    decay = numpy_helper.from_array(np.array(0.9, np.float32), "decay")
    return _save(path, nodes, inputs, outputs, _weights(1) + [decay])


def with_if(path: Path) -> Path:
    """The recurrent cell whose action is chosen by an If on the sign of the first
    observation value: control flow, which a CUDA graph cannot take."""
    from onnx import TensorProto, helper, numpy_helper
    branch = [helper.make_graph([helper.make_node("Mul", ["raw", scale], [f"out_{scale}"])], f"branch_{scale}", [],
                                [helper.make_tensor_value_info(f"out_{scale}", TensorProto.FLOAT, [1, ACTIONS])])
              for scale in ("one", "half")]
    nodes = [helper.make_node("MatMul", ["obs", "U"], ["a"]), helper.make_node("MatMul", ["h_in", "W"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["pre"]), helper.make_node("Tanh", ["pre"], ["h_out"]),
             helper.make_node("MatMul", ["h_out", "V"], ["raw"]),
             helper.make_node("Slice", ["obs", "s0", "s1", "s2"], ["first"]),
             helper.make_node("ReduceSum", ["first"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["positive"]),
             helper.make_node("If", ["positive"], ["actions"], then_branch=branch[0], else_branch=branch[1])]
    inits = _weights(2) + [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in
                           (("s0", [0], np.int64), ("s1", [1], np.int64), ("s2", [1], np.int64),
                            ("zero", 0.0, np.float32), ("one", 1.0, np.float32), ("half", 0.5, np.float32))]
    return _save(path, nodes,
                 [helper.make_tensor_value_info("obs", TensorProto.FLOAT, [1, OBS]),
                  helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [1, HIDDEN])],
                 [helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, ACTIONS]),
                  helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, HIDDEN])], inits)


def renamed(source: Path, path: Path, names: Dict[str, str]) -> Path:
    """``source`` with some of its graph inputs and outputs renamed (``names``: old -> new),
    everything else (weights, nodes, opset) as it is: the same model exported with names
    that capsule_ros's defaults do not recognise."""
    import onnx
    model = onnx.load(str(source))
    graph = model.graph
    for value in [*graph.input, *graph.output]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [names.get(name, name) for name in node.input]
        node.output[:] = [names.get(name, name) for name in node.output]
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
