"""The common `main` of the package's nodes: init, build, spin, clean shutdown on SIGINT/SIGTERM.

Signals. A terminal's Ctrl-C sends SIGINT to the whole process group, so under
``ros2 launch`` a node gets SIGINT twice: from the terminal and again from launch (then
SIGTERM if it is slow). rclpy's own handlers are not fit for that: on SIGINT they shut
the context down from another thread while a callback may be publishing (``RCLError:
publisher's context is invalid``), and Python's default handler raises KeyboardInterrupt
wherever the main thread is, a second time in the middle of the clean-up. So
``run_node`` owns SIGINT and SIGTERM for the process: the first one only asks the spin
loop to stop (a flag, checked between callbacks and at least every ``POLL_S``), later
ones are ignored. The node is then taken down in order, with the context alive until
the end: the executor stops (no callback runs any more), ``node.close()`` stops the
node's own threads (they may still publish until they are joined), the node is
destroyed, and only then is rclpy shut down. The process exits 0. From the moment the
spin loop stops, the stop signals are ignored rather than handled: a node that cleans up
fast can be exiting when launch's copy of the Ctrl-C arrives, and Python's exit puts a
handled signal back to its default (which ends the process with -2) but leaves an
ignored one ignored. (Not from inside the handler: ``signal.signal`` runs the pending
handlers first, so a burst of Ctrl-Cs would recurse.)
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Any, Callable, List, Optional

import rclpy
from rclpy.exceptions import NameValidationException, ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions

from capsule_ros.errors import CapsuleRosError, ConfigError, ErrorCode
from capsule_ros.serving.process import settle_after_start

POLL_S = 0.1          # the spin loop notices a stop request within this (rcl_wait is not interrupted)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set by the first SIGINT/SIGTERM (``signal``: which). The handler only stores:
    a burst of signals runs it nested, between any two bytecodes of whatever it runs, so
    anything more (a ``threading.Event``'s lock and condition) recursed until Python gave
    up. Once the spin loop has stopped, the stop signals are ignored until the process
    exits (``ignore_from_now``), so one that comes during the clean-up or the
    interpreter's exit (launch's copy of Ctrl-C) is harmless."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def is_set(self) -> bool:
        return self.signal is not None

    @staticmethod
    def ignore_from_now() -> None:
        """Ignore the stop signals until the process ends (Python's exit keeps an ignored
        signal ignored, where it would put a handled one back to the default)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def start_up_error(program: str, exc: BaseException) -> str:
    """The one line a start-up failure prints: what went wrong, in the error's own words.
    Set CAPSULE_ROS_TRACEBACK=1 to get the traceback as well (for a bug report)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ConfigError, ParameterException, NameValidationException)):
        return f"{program}: invalid configuration: {text}"
    if isinstance(exc, CapsuleRosError):
        return f"{program}: {ErrorCode(exc.code).name}: {text}"
    return f"{program}: cannot start ({type(exc).__name__}): {text}"


def started(node: Any) -> Any:
    """``node`` after its lifecycle autostart (``lifecycle.autostart``: configure + activate);
    a node that fails to start is closed and destroyed before the error goes on."""
    try:
        node.start()
    except BaseException:
        node.close()
        node.destroy_node()
        raise
    return node


def run_node(make_node: Callable[[], Node], program: str, argv: Optional[List[str]] = None, *,
             settle: bool = True) -> int:
    """Spin the node ``make_node()`` builds (and its ``companion_nodes``, if it has any)
    until SIGINT or SIGTERM; 0 on a clean exit,
    2 when it cannot start (a bad parameter, key file or weights file...): one line on
    stderr, never a traceback. ``settle``: freeze start-up's objects for the garbage
    collector once the node is built (a lifecycle node does it itself when it activates)."""
    stop = StopRequest()
    stop.install()                  # before init: a Ctrl-C while the node is built stops it cleanly
    rclpy.init(args=argv if argv is not None else sys.argv, signal_handler_options=SignalHandlerOptions.NO)
    try:
        node = make_node()
    except Exception as exc:  # noqa: BLE001 - every start-up error: one line and exit 2
        if os.environ.get("CAPSULE_ROS_TRACEBACK"):
            traceback.print_exc()
        print(start_up_error(program, exc), file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    if settle:
        settle_after_start()                   # no multi-ms garbage collections during the loop
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    for companion in getattr(node, "companion_nodes", ()):     # fleet_node's robots: the same executor
        executor.add_node(companion)
    try:
        while not stop.is_set() and rclpy.ok():
            executor.spin_once(timeout_sec=POLL_S)
    except ExternalShutdownException:
        pass
    finally:
        stop.ignore_from_now()
        executor.shutdown(timeout_sec=1.0)
        close = getattr(node, "close", None)
        if close is not None:
            close()                 # the node's threads: joined while the context is still valid
        node.destroy_node()
        rclpy.try_shutdown()
    return 0
