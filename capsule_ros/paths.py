"""Where the package's data files are: the installed share directory first (a colcon build,
``share/capsule_ros/...``), then the source tree (a checkout, a pip install of the core,
the GPU machine without ROS)."""
from __future__ import annotations

from pathlib import Path
from typing import List

PACKAGE = "capsule_ros"
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def share_dirs(*parts: str) -> List[Path]:
    """The candidate directories for ``share/capsule_ros/<parts>``, installed first; only
    those that exist."""
    found = []
    try:
        from ament_index_python.packages import get_package_share_directory
        found.append(Path(get_package_share_directory(PACKAGE)).joinpath(*parts))
    except Exception:  # noqa: BLE001 - no ROS, or the package is not installed
        pass
    found.append(SOURCE_ROOT.joinpath(*parts))
    return [d for d in found if d.is_dir()]


def share_file(*parts: str) -> Path:
    """A file of ``share/capsule_ros`` (e.g. ``share_file("config", "policy.yaml")``): the
    installed copy, else the source tree's (which may not exist: callers report that)."""
    for directory in share_dirs(*parts[:-1]):
        if (directory / parts[-1]).is_file():
            return directory / parts[-1]
    return SOURCE_ROOT.joinpath(*parts)
