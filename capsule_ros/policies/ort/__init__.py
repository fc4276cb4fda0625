"""``policy.kind: onnx``: an ONNX model (an Isaac Lab / rsl_rl ``policy.onnx``, an
sb3-contrib export, any model with explicit state inputs and outputs) run by ONNX
Runtime over the arena, its observation assembled from ports as Isaac Lab's observation
terms are, its action mapped to joint targets (docs/onnx.md is the guide).

- ``model``: reading the file (digest, shapes, control flow) and the in-place analysis;
- ``interface``: which tensor is the observation, the action, a state pair, the
  episode-start flag, and the arena buffer each binds to;
- ``observations``: the observation terms and their in-place assembly;
- ``policy``: ``OnnxPolicy`` (IO binding, the step, the CUDA provider path);
- ``kind``: the settings section ``policy.onnx`` and the build.
"""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "OnnxConfig": "capsule_ros.policies.ort.kind",
    "OnnxModelError": "capsule_ros.policies.ort.model",
    "OnnxPolicy": "capsule_ros.policies.ort.policy",
    "ObservationPlan": "capsule_ros.policies.ort.observations",
    "read_model": "capsule_ros.policies.ort.model",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
