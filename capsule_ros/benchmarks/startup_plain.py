"""The plain side of ``capsule-ros bench startup``: load one model the plain way and hand
out one action, in a fresh process, as a user would without capsule_ros.

    python startup_plain.py onnx MODEL.onnx      ONNX Runtime only (nothing of capsule_ros)
    python startup_plain.py torch PARAMS.json    the policy kind's own build (its model code
                                                 and weights) in plain torch: no arena,
                                                 runtime, capsules, session or ROS
    python startup_plain.py torch-native PARAMS.json   the same at this CPU's own vector level

It is run as a script by its path, so an ONNX model's side imports no torch and no
capsule_ros. It prints ``first action`` and the action once it has one; the benchmark
times the process from its launch to that line. Both sides run one intra-op thread, as the
node does (``runtime.cpu_threads: 1``). ``torch`` computes at the CPU vector level the
node pins (``runtime.numerics``, portable by default: AVX2 kernels, which plan a chunk
slower than this CPU's own, AVX-512 here), so that the two sides run the same kernels and
the difference is start-up; ``torch-native`` does not pin it, as torch does by default.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List


def onnx_action(model: str) -> List[float]:
    import numpy as np
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.float32)
             for i in session.get_inputs()}
    return [float(v) for v in np.asarray(session.run(None, feeds)[0]).ravel()]


def torch_action(params_file: str, native: bool) -> List[float]:
    params = json.loads(Path(params_file).read_text())
    if not native:                   # before torch's first operation, which fixes the level
        from capsule_ros.runtime import numerics
        numerics.pin(params.get("runtime", {}).get("numerics", numerics.NATIVE))
    import torch
    torch.set_num_threads(1)
    from capsule_ros.policies.registry import BuildContext, policy_kind
    from capsule_ros.runtime.arena import BufferKind, BufferSpec, dtype_from_name
    from capsule_ros.serving.config import ServingConfig
    config = ServingConfig.from_params(params)
    inputs = tuple(BufferSpec(name, port.shape, dtype_from_name(port.dtype), BufferKind.INPUT)
                   for name, port in config.ports.items())
    weights: Any = config.policy.weights or None
    if weights is not None and weights.startswith("builtin:"):          # as policy.weights resolves it
        from capsule_ros import policies
        weights = Path(policies.__file__).parent / f"{weights[len('builtin:'):]}.safetensors"
    context = BuildContext(settings=config.policy_settings, inputs=inputs, ports=config.ports, weights=weights,
                           seed=config.policy.init_seed, device=torch.device("cpu"))
    policy = policy_kind(config.policy.kind).build(context).eval()
    state = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in policy.state_spec()}
    with torch.inference_mode():
        policy.init_state(state, episode=1, seed=0)
        policy.step(state)
    return [float(v) for v in state["action"].ravel()]


def main(argv: List[str]) -> int:
    kind, path = argv
    action = onnx_action(path) if kind == "onnx" else torch_action(path, native=kind == "torch-native")
    print("first action", json.dumps(action[:4]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
