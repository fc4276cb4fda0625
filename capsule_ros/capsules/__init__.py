"""Execution-state capsules (no ROS): the store (snapshot, restore, fork, move over device
and pinned-host slab pools), the on-disk format with its recipe section, and the atomic
capsule directory."""
from capsule_ros._lazy import lazy_exports

_EXPORTS = {
    "CapsuleStore": "capsule_ros.capsules.store",
    "Capsule": "capsule_ros.capsules.store",
    "Tier": "capsule_ros.capsules.store",
    "Loan": "capsule_ros.capsules.store",
    "CapsuleStoreConfig": "capsule_ros.capsules.config",
    "CapsuleDirectory": "capsule_ros.capsules.directory",
    "check_capsule_id": "capsule_ros.capsules.ids",
    "new_capsule_id": "capsule_ros.capsules.ids",
    "read_capsule": "capsule_ros.capsules.fileformat",
    "write_capsule": "capsule_ros.capsules.fileformat",
    "verify_capsule": "capsule_ros.capsules.fileformat",
    "read_header": "capsule_ros.capsules.fileformat",
    "read_recipe": "capsule_ros.capsules.fileformat",
    "Recipe": "capsule_ros.capsules.recipe",
    "RecipeInfo": "capsule_ros.capsules.recipe",
    "RecipeRoot": "capsule_ros.capsules.recipe",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
