"""Answers that still reach a client the middleware had not finished discovering.

A client sends its first request the moment it sees the server (a behaviour tree that
starts with the node, ``ros2 service call``). The request can arrive before the server
has matched the client's reply reader: rmw_fastrtps then waits 100 ms for the match and
drops the answer ("failed to send response (timeout): client will not receive
response"), which rclpy only reports as a RuntimeWarning. The client waits for nothing
until its own timeout, and on a busy machine discovery often takes longer than 100 ms. A
commit or a record must not be lost that way (asking again would do it twice), so the
capsule services send such an answer again, from a thread of its own, until the match is
made or ``retry_for_s`` has passed.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable

DROPPED = r"failed to send response \(timeout\)"     # rclpy's warning for an answer rmw did not send


def _dropped(exc: BaseException) -> bool:
    """``exc`` is rclpy's dropped-answer warning raised as an error (directly, or as the
    cause of the SystemError its C extension then raises)."""
    warning = exc if isinstance(exc, RuntimeWarning) else exc.__cause__
    return isinstance(warning, RuntimeWarning) and "failed to send response" in str(warning)


class LateReplies:
    """Wraps services' ``send_response`` so an answer the middleware dropped is sent again.

    Spotting the drop means raising rclpy's warning as an error for the one call, and
    ``warnings.catch_warnings`` changes process-wide state: the class's lock keeps two
    sends from interleaving their filters (it is held for one send, at most the 100 ms
    rmw waits)."""

    _warnings_lock = threading.Lock()

    def __init__(self, logger: Any, *, retry_every_s: float = 0.05, retry_for_s: float = 10.0):
        self._logger = logger
        self.retry_every_s, self.retry_for_s = retry_every_s, retry_for_s

    def keep(self, service: Any) -> Any:
        """``service`` with answers that survive a late match (the executor calls
        ``service.send_response``); returns it."""
        send = service.send_response

        def send_response(response: Any, header: Any) -> None:
            if not self.sent(send, response, header):
                threading.Thread(target=self._retry, args=(service.srv_name, send, response, header),
                                 name="late-reply", daemon=True).start()
        service.send_response = send_response
        return service

    def sent(self, send: Callable[[Any, Any], None], response: Any, header: Any) -> bool:
        """Send once; False when the middleware dropped the answer."""
        with self._warnings_lock, warnings.catch_warnings():
            warnings.filterwarnings("error", message=DROPPED, category=RuntimeWarning)
            try:
                send(response, header)
            except (RuntimeWarning, SystemError) as exc:
                if not _dropped(exc):
                    raise
                return False
        return True

    def _retry(self, name: str, send: Callable[[Any, Any], None], response: Any, header: Any) -> None:
        start = time.monotonic()
        attempts = 1
        while time.monotonic() - start < self.retry_for_s:
            time.sleep(self.retry_every_s)
            attempts += 1
            try:
                if self.sent(send, response, header):
                    self._logger.info(f"{name}: answered on attempt {attempts}, "
                                      f"{(time.monotonic() - start) * 1e3:.0f} ms late (the client's reply "
                                      "reader was still being discovered)")
                    return
            except Exception as exc:  # noqa: BLE001 - the service is gone (shutdown): nothing to answer
                self._logger.warning(f"{name}: the answer was not sent: {exc!r}")
                return
        self._logger.warning(f"{name}: the answer was not sent: the client's reply reader was not discovered "
                             f"within {self.retry_for_s:.0f} s ({attempts} attempts)")


__all__ = ["LateReplies"]
