"""Python ``logging`` of the library (graph capture and its memory, capsule pools,
recompute fallbacks, evictions...) into the node's ROS logger: the console ROS users read
and ``/rosout``, where ``rqt_console`` and rosbags see it.

The core modules log with ``logging.getLogger(__name__)`` and stay ROS-free; the node
installs one handler on the ``capsule_ros`` logger for its lifetime. Levels map one to
one (rclpy's severities have Python's numbers), the Python logger follows the ROS
logger's level (``--ros-args --log-level``), and records do not propagate to Python's root
logger meanwhile, so nothing is printed twice.
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

    @classmethod
    def install(cls, ros_logger) -> RosLogBridge:
        bridge = cls(ros_logger)
        library = bridge._library
        library.addHandler(bridge)
        library.setLevel(int(ros_logger.get_effective_level()) or logging.INFO)
        library.propagate = False
        return bridge

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"[{record.name.removeprefix(LIBRARY_LOGGER + '.')}] {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            level = record.levelno
            log = (self.ros_logger.fatal if level >= logging.CRITICAL else self.ros_logger.error
                   if level >= logging.ERROR else self.ros_logger.warning if level >= logging.WARNING
                   else self.ros_logger.info if level >= logging.INFO else self.ros_logger.debug)
            log(text)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)

    def remove(self) -> None:
        """Detach; the library logger gets its level and propagation back."""
        self._library.removeHandler(self)
        self._library.setLevel(self._saved[0])
        self._library.propagate = self._saved[1]
