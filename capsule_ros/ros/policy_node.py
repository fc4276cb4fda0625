"""`policy_node` executable: the serving node (its threads are described in ros/node.py)."""
from __future__ import annotations

import sys
from typing import List, Optional

from capsule_ros.ros.entry import run_node, started


def main(argv: Optional[List[str]] = None) -> int:
    def make():
        from capsule_ros.ros.node import PolicyNode  # after rclpy.init: torch's import is slow
        return started(PolicyNode())
    return run_node(make, "policy_node", argv, settle=False)


if __name__ == "__main__":
    sys.exit(main())
