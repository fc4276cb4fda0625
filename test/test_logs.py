"""The library's Python logging reaches /rosout with each record's severity, from the
serving node: in process (one library logger, every severity) and from the installed
``policy_node`` (a real warning of the capsule directory beside the start-up lines)."""
from __future__ import annotations

import logging
import os

import pytest
from harness import ClientNode, start_policy_node, wait_for

pytestmark = pytest.mark.ros

SEVERITIES = {logging.INFO: 20, logging.WARNING: 30, logging.ERROR: 40, logging.CRITICAL: 50}   # rcl_interfaces/Log


def rosout(client: ClientNode):
    from rcl_interfaces.msg import Log
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    return client.subscribe(Log, "/rosout", QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                                                       durability=DurabilityPolicy.TRANSIENT_LOCAL))


def test_every_severity_of_one_library_logger_reaches_rosout(rclpy_context, capfd):
    """rclpy binds one severity to each call site of its logger: the bridge must not call
    it from one line for all of them (a second severity was refused, on stderr)."""
    from capsule_ros.ros.node import PolicyNode
    name = f"log_bridge_{os.getpid()}"
    node = PolicyNode(name)
    client = ClientNode(rclpy_context, f"{name}_client")
    logs = rosout(client)
    library = logging.getLogger("capsule_ros.serving.recompute")
    try:
        wait_for(lambda: client.node.count_publishers("/rosout") >= 2, timeout=20, what="the node's /rosout")
        for level in (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL, logging.WARNING,
                      logging.INFO, logging.DEBUG):
            library.log(level, "record at %s", logging.getLevelName(level))
        seen = []

        def bridged():
            seen.extend(m for m in ClientNode.drain(logs) if m.name == name and m.msg.startswith("[serving.recompute]"))
            return seen
        wait_for(lambda: len(bridged()) >= 6, timeout=20, what="six bridged records on /rosout")
        assert [(m.level, m.msg) for m in seen] == [
            (SEVERITIES[level], f"[serving.recompute] record at {logging.getLevelName(level)}")
            for level in (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL, logging.WARNING,
                          logging.INFO)], "DEBUG is below the node's level; the rest in order, each at its severity"
        assert "Logging error" not in capfd.readouterr().err
    finally:
        client.close()
        node.close()
        node.destroy_node()


def test_policy_node_reports_a_library_warning_and_its_info_lines(tmp_path, rclpy_context):
    """The installed node at start-up: the capsule directory moves a crash's unfinished save
    aside (WARNING, at configure), then the runtime and the store report (INFO)."""
    ns = f"/logs{os.getpid() % 10000}"
    directory = tmp_path / "capsules"
    directory.mkdir(mode=0o700)
    (directory / "e1.s3.abcdef.capsule.part").write_bytes(b"half a capsule")
    client = ClientNode(rclpy_context, f"log_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
    logs = rosout(client)
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}, "capsules": {"directory": str(directory)}},
                             namespace=ns)
    try:
        seen = []

        def library():
            seen.extend(m for m in ClientNode.drain(logs) if m.name == f"{ns.strip('/')}.capsule_policy"
                        and m.msg.startswith(("[capsules.directory]", "[runtime.engine]", "[capsules.store]")))
            return seen
        wait_for(lambda: len(library()) >= 3, timeout=60, what="the directory's, the runtime's and the store's lines")
        levels = {m.msg.split("]")[0] + "]": m.level for m in seen}
        assert levels == {"[capsules.directory]": 30, "[runtime.engine]": 20, "[capsules.store]": 20}, seen
        assert any("moved the unfinished save e1.s3.abcdef.capsule.part" in m.msg for m in seen)
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()
    assert "Logging error" not in proc.log() and "severity cannot be changed" not in proc.log()
