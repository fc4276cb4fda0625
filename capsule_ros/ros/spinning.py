"""Spin rclpy nodes in a background thread, for clients that call services from their
own thread (tests, benchmarks, the demo, behaviour trees).

A SingleThreadedExecutor: its callbacks here are tiny (queue a message, complete a
future), and rclpy's MultiThreadedExecutor spins while its pool works, which slows the
whole round trip on a small machine (docs/benchmarks.md, "Executor: single-threaded vs
MultiThreadedExecutor").
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.task import Future


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


class SpinSafeActionClient(ActionClient):
    """An rclpy ActionClient that can be made on a node another thread is spinning.

    rclpy's constructor hands the client to the node (``add_waitable``) before it makes the
    lock that ``get_num_entities`` takes; an executor spinning in another thread can ask for
    the entities in between, and its thread dies of an AttributeError (then no service reply
    or goal response of that node arrives). The lock here exists before the node sees the
    client; rclpy's own then replaces it, before anything can use the client."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)


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


class Offload:
    """Blocking work on worker threads, awaited by a coroutine callback (a service or an
    action's execute): the executor's thread stays free for the control loop while the
    work waits for a step boundary, a disk or a whole policy run."""

    def __init__(self, node: Node, workers: int, name: str):
        self._node = node
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker; its result (or exception) once done."""
        done: Future = Future(executor=self._node.executor)
        done.add_done_callback(lambda _f: None)        # completion wakes the executor to resume us

        def work() -> None:
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                done.set_exception(exc)
        self._pool.submit(work)
        return await done

    def shutdown(self) -> None:
        """Let running work finish; drop work not started yet."""
        self._pool.shutdown(wait=True, cancel_futures=True)
