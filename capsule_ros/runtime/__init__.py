"""The graph runtime (no ROS): one arena of named state buffers per policy, the policy
protocol, the graph plan (CUDA-graph capture and replay; the same plan eagerly on a CPU),
the fingerprint that binds capsules to a graph, and safetensors weights."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "PolicyRuntime": "capsule_ros.runtime.engine",
    "RuntimeConfig": "capsule_ros.runtime.engine",
    "StepOutputs": "capsule_ros.runtime.engine",
    "StatefulPolicy": "capsule_ros.runtime.policy",
    "standard_specs": "capsule_ros.runtime.policy",
    "ArenaLayout": "capsule_ros.runtime.arena",
    "StateArena": "capsule_ros.runtime.arena",
    "BufferSpec": "capsule_ros.runtime.arena",
    "BufferKind": "capsule_ros.runtime.schema",
    "GraphPlan": "capsule_ros.runtime.plan",
    "PolicyStepError": "capsule_ros.runtime.plan",
    "compute_fingerprint": "capsule_ros.runtime.fingerprint",
    "FingerprintParts": "capsule_ros.runtime.fingerprint",
    "load_weights": "capsule_ros.runtime.weights",
    "save_weights": "capsule_ros.runtime.weights",
    "counter_normal": "capsule_ros.runtime.rng",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
