"""Python ``logging`` of the library (graph capture and its memory, capsule pools,
recompute fallbacks, evictions...) into the node's ROS logger: the console ROS users read
and ``/rosout``, where ``rqt_console`` and rosbags see it.

The core modules log with ``logging.getLogger(__name__)`` and stay ROS-free; the node
installs one handler on the ``capsule_ros`` logger for its lifetime. Levels map one to
one (rclpy's severities have Python's numbers), the Python logger follows the ROS
logger's level (``--ros-args --log-level``), and records do not propagate to Python's root
logger meanwhile, so nothing is printed twice.

rclpy binds a severity to each *call site* of its logger (file, line and bytecode offset:
a second severity from the same call raises "Logger severity cannot be changed between
calls"), so ``emit`` calls each severity's method from a line of its own.

In a process that imported ROS 2 ``launch`` (launch_testing, pytest with launch_pytest, a
node run in-process), every Python logger created afterwards does not propagate to its
parent (``launch.logging.LaunchLogger``), so the library's module loggers would never reach
this handler; ``install`` turns propagation back on for the existing ``capsule_ros.*``
loggers (``remove`` restores them).
"""
from __future__ import annotations

import logging

LIBRARY_LOGGER = "capsule_ros"


class RosLogBridge(logging.Handler):
    """Forwards ``capsule_ros.*`` records to an rclpy logger (see the module docstring)."""

    def __init__(self, ros_logger):
        super().__init__()
        self.ros_logger = ros_logger
        self._library = logging.getLogger(LIBRARY_LOGGER)
        self._saved = (self._library.level, self._library.propagate)
        self._reconnected: list = []           # child loggers whose propagation install turned back on

    @classmethod
    def install(cls, ros_logger) -> RosLogBridge:
        bridge = cls(ros_logger)
        library = bridge._library
        library.addHandler(bridge)
        library.setLevel(int(ros_logger.get_effective_level()) or logging.INFO)
        library.propagate = False
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith(LIBRARY_LOGGER + ".") and isinstance(logger, logging.Logger) and not logger.propagate:
                logger.propagate = True
                bridge._reconnected.append(logger)
        return bridge

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"[{record.name.removeprefix(LIBRARY_LOGGER + '.')}] {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            level, ros = record.levelno, self.ros_logger
            if level >= logging.CRITICAL:           # one call site per severity (module docstring)
                ros.fatal(text)
            elif level >= logging.ERROR:
                ros.error(text)
            elif level >= logging.WARNING:
                ros.warning(text)
            elif level >= logging.INFO:
                ros.info(text)
            else:
                ros.debug(text)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def remove(self) -> None:
        """Detach; the library logger gets its level and propagation back."""
        self._library.removeHandler(self)
        self._library.setLevel(self._saved[0])
        self._library.propagate = self._saved[1]
        for logger in self._reconnected:
            logger.propagate = False
