"""CapsuleClient: one service-calling helper with typed errors, thin wrappers per service.

Used by behaviour-tree leaves, benchmarks, the demo and tests. One rclpy client per
service, created once (never a new client per call). Failures are typed the way
BehaviorTree.ROS2 reports them: the server is unreachable, the call timed out, or the
server answered ``success=false`` (``ServiceRefused`` carries its ``error_code``).

The caller spins the node (an executor thread); calls block the calling thread on the
response future, so never call from a callback of the same single-threaded executor.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Type

from rclpy.node import Node

from capsule_ros import srv
from capsule_ros.errors import ErrorCode

QUERY_RESEND_S = 2.0          # an unanswered idempotent query is sent again after this long


class ServiceError(Exception):
    """Base of the client's typed failures."""


class ServiceUnavailable(ServiceError):
    """The server did not appear within the server-wait timeout (BT: SERVICE_UNREACHABLE)."""


class ServiceTimeout(ServiceError):
    """No response within the call timeout (BT: SERVICE_TIMEOUT)."""


class ServiceRefused(ServiceError):
    """The server answered success=false (BT: the leaf returns FAILURE with this code)."""

    def __init__(self, service: str, error_code: int, message: str):
        name = ErrorCode(error_code).name if error_code in ErrorCode._value2member_map_ else str(error_code)
        super().__init__(f"{service}: {name}: {message}")
        self.error_code = error_code
        self.response_message = message


SERVICES: Dict[str, Type] = {
    "commit": srv.Commit, "reset": srv.Reset, "interrupt": srv.Interrupt, "reenter": srv.Reenter,
    "fork": srv.Fork, "list_capsules": srv.ListCapsules, "drop_capsule": srv.DropCapsule,
    "save_capsule": srv.SaveCapsule, "load_capsule": srv.LoadCapsule, "record": srv.Record,
}


def call_service(client, request: Any, server_wait_s: float, call_timeout_s: float, *,
                 resend_s: Optional[float] = None) -> Any:
    """Call ``client`` and wait for its response: ServiceUnavailable when the server is not
    there within ``server_wait_s``, ServiceTimeout (the request dropped) after ``call_timeout_s``.

    ``resend_s`` (idempotent queries only): send the request again when no response came
    within that long. A server that has only just been discovered can miss a request (its
    reply path to this client not yet matched); a query may safely ask twice."""
    if not client.service_is_ready() and not client.wait_for_service(timeout_sec=server_wait_s):
        raise ServiceUnavailable(f"{client.srv_name} not available after {server_wait_s:.1f} s")
    deadline = time.monotonic() + call_timeout_s
    while True:
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _f, done=done: done.set())
        left = deadline - time.monotonic()
        if done.wait(left if resend_s is None else min(resend_s, max(left, 0.0))):
            return future.result()
        client.remove_pending_request(future)
        if time.monotonic() >= deadline:
            raise ServiceTimeout(f"{client.srv_name}: no response within {call_timeout_s * 1e3:.0f} ms")


class LifecycleClient:
    """The standard lifecycle services of a managed node such as ``policy_node``
    (``~/get_state``, ``~/change_state``), as ``ros2 lifecycle`` uses them."""

    def __init__(self, node: Node, node_path: str = "/capsule_policy", *, server_wait_s: float = 5.0,
                 call_timeout_s: float = 60.0):
        from lifecycle_msgs.srv import ChangeState, GetState
        self.node, self.node_path = node, node_path.rstrip("/")
        self.server_wait_s, self.call_timeout_s = server_wait_s, call_timeout_s
        self._get = node.create_client(GetState, f"{self.node_path}/get_state")
        self._change = node.create_client(ChangeState, f"{self.node_path}/change_state")

    def state(self) -> str:
        """The current state's label: unconfigured, inactive, active, finalized..."""
        from lifecycle_msgs.srv import GetState
        return call_service(self._get, GetState.Request(), self.server_wait_s, self.call_timeout_s,
                            resend_s=QUERY_RESEND_S).current_state.label

    def change(self, transition: str) -> bool:
        """Run a transition by its label (configure, activate, deactivate, cleanup, shutdown);
        whether it succeeded (a configure with a bad configuration does not)."""
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState
        request = ChangeState.Request(transition=Transition(label=transition))
        return bool(call_service(self._change, request, self.server_wait_s, self.call_timeout_s).success)

    def destroy(self) -> None:
        self.node.destroy_client(self._get)
        self.node.destroy_client(self._change)


class CapsuleClient:
    """Calls the services of one policy node (``node_path`` like "/capsule_policy")."""

    def __init__(self, node: Node, node_path: str = "/capsule_policy", *, server_wait_s: float = 5.0,
                 call_timeout_s: float = 2.0):
        self.node = node
        self.node_path = node_path.rstrip("/")
        self.server_wait_s = server_wait_s
        self.call_timeout_s = call_timeout_s
        self._clients = {name: node.create_client(t, f"{self.node_path}/{name}") for name, t in SERVICES.items()}

    def call(self, name: str, request: Any = None, *, server_wait_s: Optional[float] = None,
             call_timeout_s: Optional[float] = None, check: bool = True) -> Any:
        """Call service ``name``; returns the response (raises ServiceRefused on
        success=false when ``check``)."""
        response = call_service(self._clients[name], request if request is not None else SERVICES[name].Request(),
                                self.server_wait_s if server_wait_s is None else server_wait_s,
                                self.call_timeout_s if call_timeout_s is None else call_timeout_s)
        if check and not response.success:
            raise ServiceRefused(self._clients[name].srv_name, response.error_code, response.message)
        return response

    def ready(self) -> bool:
        """Every service of the node is available now."""
        return all(client.service_is_ready() for client in self._clients.values())

    # thin wrappers -------------------------------------------------------------------------
    def commit(self, label: str = "", persist: bool = False, pin: bool = False, **kw):
        return self.call("commit", srv.Commit.Request(label=label, persist=persist, pin=pin), **kw)

    def reset(self, capsule_id: str = "", **kw):
        return self.call("reset", srv.Reset.Request(capsule_id=capsule_id), **kw)

    def interrupt(self, hold_mode: int = srv.Interrupt.Request.HOLD_LAST, commit: bool = True, **kw):
        return self.call("interrupt", srv.Interrupt.Request(hold_mode=hold_mode, commit=commit), **kw)

    def reenter(self, capsule_id: str = "", **kw):
        return self.call("reenter", srv.Reenter.Request(capsule_id=capsule_id), **kw)

    def fork(self, capsule_id: str = "", label: str = "", **kw):
        return self.call("fork", srv.Fork.Request(capsule_id=capsule_id, label=label), **kw)

    def list_capsules(self, current_episode_only: bool = False, **kw):
        return self.call("list_capsules", srv.ListCapsules.Request(current_episode_only=current_episode_only), **kw)

    def drop(self, capsule_id: str, from_disk: bool = False, **kw):
        return self.call("drop_capsule", srv.DropCapsule.Request(capsule_id=capsule_id, from_disk=from_disk), **kw)

    def save(self, capsule_id: str, **kw):
        return self.call("save_capsule", srv.SaveCapsule.Request(capsule_id=capsule_id), **kw)

    def load(self, capsule_id: str, **kw):
        return self.call("load_capsule", srv.LoadCapsule.Request(capsule_id=capsule_id), **kw)

    def record(self, start: bool, path: str = "", storage: str = "", **kw):
        return self.call("record", srv.Record.Request(start=start, path=path, storage=storage), **kw)

    def destroy(self) -> None:
        for client in self._clients.values():
            self.node.destroy_client(client)
