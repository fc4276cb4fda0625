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
