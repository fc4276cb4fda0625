"""Policies served by capsule_ros beyond the reference ones in ``capsule_ros.runtime``,
and the shipped weights of the built-in policies (``*.safetensors`` + ``*.json``)."""

from capsule_ros._lazy import lazy_exports  # noqa: E402

_EXPORTS = {
    "ExportedPolicy": "capsule_ros.policies.exported",
    "HybridPolicy": "capsule_ros.policies.hybrid",
    "HybridConfig": "capsule_ros.policies.hybrid",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
