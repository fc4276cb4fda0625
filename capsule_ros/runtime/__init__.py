"""The runtime core (no ROS): one arena of named state buffers per policy, the policy
protocol, the execution-mode protocol with its every-step default (a mode above the core,
such as ``capsule_ros.chunking``, implements it), the programs captured as CUDA graphs
(run eagerly on a CPU), the runtime and its builder, the fingerprint that binds capsules
to a runtime, the opaque mode mark capsules carry, and safetensors weights. The core owns
no loop and no thread."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "PolicyRuntime": "capsule_ros.runtime.engine",
    "RuntimeConfig": "capsule_ros.runtime.engine",
    "StepOutputs": "capsule_ros.runtime.engine",
    "build_policy_runtime": "capsule_ros.runtime.builder",
    "replica_of": "capsule_ros.runtime.builder",
    "runtime_identity": "capsule_ros.runtime.builder",
    "ExecutionMode": "capsule_ros.runtime.mode",
    "ModeSetup": "capsule_ros.runtime.mode",
    "EVERY_STEP": "capsule_ros.runtime.mode",
    "StepReport": "capsule_ros.runtime.mode",
    "ModeMark": "capsule_ros.runtime.marks",
    "StatefulPolicy": "capsule_ros.runtime.policy",
    "standard_specs": "capsule_ros.runtime.policy",
    "ArenaLayout": "capsule_ros.runtime.arena",
    "StateArena": "capsule_ros.runtime.arena",
    "BufferSpec": "capsule_ros.runtime.arena",
    "BufferKind": "capsule_ros.runtime.schema",
    "ProgramGraphs": "capsule_ros.runtime.graphs",
    "PolicyStepError": "capsule_ros.runtime.graphs",
    "compute_fingerprint": "capsule_ros.runtime.fingerprint",
    "FingerprintParts": "capsule_ros.runtime.fingerprint",
    "RuntimeIdentity": "capsule_ros.runtime.fingerprint",
    "load_weights": "capsule_ros.runtime.weights",
    "save_weights": "capsule_ros.runtime.weights",
    "counter_normal": "capsule_ros.runtime.rng",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
