"""`fleet_node` executable: many robots from the batch slots of one runtime, each under its
own namespace with policy_node's interface (capsule_ros/ros/fleet.py; docs/fleet.md)."""
from __future__ import annotations

import sys
from typing import List, Optional

from capsule_ros.ros.entry import run_node, started


def main(argv: Optional[List[str]] = None) -> int:
    def make():
        from capsule_ros.ros.fleet import FleetNode  # after rclpy.init: torch's import is slow
        return started(FleetNode())
    return run_node(make, "fleet_node", argv, settle=False)


if __name__ == "__main__":
    sys.exit(main())
