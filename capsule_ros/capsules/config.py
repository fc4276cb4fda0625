"""The ``capsules`` configuration section (torch-free: the command line reads its defaults)."""
from __future__ import annotations

from dataclasses import dataclass

from capsule_ros.config import ConfigSection, setting


@dataclass(frozen=True)
class CapsuleStoreConfig(ConfigSection):
    """Capsule pools and the capsule directory."""

    SECTION = "capsules"

    device_budget_mb: float = setting(256.0, "MiB of capsules kept on the device (allocated at start)",
                                      low=0.0, high=1 << 24, read_only=True)
    host_budget_mb: float = setting(1024.0, "MiB of capsules kept in (pinned) host memory (allocated at start)",
                                    low=0.0, high=1 << 24, read_only=True)
    directory: str = setting("~/.ros/capsule_ros/{node}/capsules",
                             "capsule directory for save/load, one per node ({node}: the node's name; '' = none)",
                             read_only=True)
    key_file: str = setting("", "key-encryption key file (32 raw bytes, mode 0600); '' = no encryption",
                            read_only=True)
    chunk_mb: float = setting(4.0, "payload chunk size on disk (each verified on its own)", low=0.0625,
                              high=64.0, read_only=True)
    max_file_mb: float = setting(65536.0, "largest capsule file the loader accepts", low=1.0, high=1 << 24,
                                 read_only=True)
    recipe: bool = setting(True, "saved capsules carry their recipe (root, input rows, actions: "
                           "docs/model-updates.md), so they can be rebuilt by the recompute fallback in any run of "
                           "the node and regenerated for a new model", read_only=True)
    recipe_max_mb: float = setting(64.0, "largest recipe a save copies (under the step boundary) and writes; a "
                                   "larger one is cut: the capsule is marked not regenerable, with the reason",
                                   low=0.0, high=1 << 20, read_only=True)
    regenerate_stale: bool = setting(False, "at activate, regenerate in the background the capsule files of another "
                                     "fingerprint that carry a recipe, for this model (low priority, off the control "
                                     "loop; each file is replaced atomically when complete)", read_only=True)
    regenerate_nice: int = setting(19, "OS niceness of the background regeneration's process: 19 takes only the CPU "
                                   "time nothing else wants, so on a saturated machine it waits; lower lets it make "
                                   "progress against other work of the same priority", low=0, high=19, read_only=True)
