"""Spin rclpy nodes in a background thread, for clients that call services from their
own thread (tests, benchmarks, the demo, behaviour trees).

A SingleThreadedExecutor: its callbacks here are tiny (queue a message, complete a
future), and rclpy's MultiThreadedExecutor spins while its pool works; measured, it
turned a 3 ms sensor-to-action round trip into 30-60 ms on a 2-core machine.
"""
from __future__ import annotations

import queue
import threading

from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node


class SpinThread:
    """``nodes`` spun by one executor in a daemon thread until ``shutdown`` (``context``: a
    private rclpy context, else the default one)."""

    def __init__(self, *nodes: Node, name: str = "capsule-ros-spin", context=None):
        self.executor = SingleThreadedExecutor(context=context)
        for node in nodes:
            self.executor.add_node(node)
        self.thread = threading.Thread(target=self.executor.spin, name=name, daemon=True)
        self.thread.start()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop spinning and join the thread: before destroying the nodes and
        ``rclpy.shutdown()`` (a thread still inside rclpy at interpreter exit aborts it)."""
        self.executor.shutdown(timeout_sec=timeout_s)
        self.thread.join(timeout_s)


class SpunNode:
    """A new rclpy node, spun in its own background thread (rclpy initialised by the caller)."""

    def __init__(self, rclpy_module, name: str, **node_kwargs):
        self.node = rclpy_module.create_node(name, **node_kwargs)
        self._spin = SpinThread(self.node, name=f"{name}-spin", context=node_kwargs.get("context"))

    def close(self) -> None:
        self._spin.shutdown()
        self.node.destroy_node()


def drain(q: queue.Queue) -> list:
    """Everything a subscription callback queued so far (without waiting)."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
