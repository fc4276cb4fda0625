"""The policies capsule_ros serves (``policy.kind``; the registry in ``registry.py``):
the reference hybrid policy (``hybrid.py``) and the shipped weights of the default one
(``arm_reach.safetensors`` + ``.json``), exported ``torch.export`` programs (``exported.py``),
LeRobot ACT / Diffusion (``lerobot/``) and ONNX models run by ONNX Runtime over the arena
(``ort/``, ``policy.kind: onnx``: IO binding, state pairs, Isaac Lab's observation terms).
They implement the runtime's policy protocol (``capsule_ros.runtime.policy``); the graph
fingerprint is the runtime's
(``capsule_ros.runtime.fingerprint``)."""

from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "ExportedPolicy": "capsule_ros.policies.exported",
    "HybridPolicy": "capsule_ros.policies.hybrid",
    "HybridConfig": "capsule_ros.policies.hybrid",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
