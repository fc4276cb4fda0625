"""CapsuleClient: one service-calling helper with typed errors, and a method per verb of
the verb table (``capsule_ros.serving.verbs``), built from it.

Used by benchmarks, the demo, the node replay target and tests (the behaviour-tree
leaves call asynchronously, ``capsule_ros.bt``). One rclpy client per service, created
once (never a new client per call). Failures are typed the way
BehaviorTree.ROS2 reports them: the server is unreachable, the call timed out, or the
server answered ``success=false`` (``ServiceRefused`` carries its ``error_code``).

The caller spins the node (an executor thread); calls block the calling thread on the
response future, so never call from a callback of the same single-threaded executor.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from rclpy.node import Node

from capsule_ros.errors import ErrorCode
from capsule_ros.ros.discovery import DiscoveryGrace
from capsule_ros.ros.messages import service_qos, srv_type
from capsule_ros.serving.verbs import BY_NAME, VERBS, Verb, find_verb

QUERY_RESEND_S = 2.0          # an unanswered idempotent request is sent again after this long


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


def call_service(client: Any, request: Any, server_wait_s: float, call_timeout_s: float, *,
                 resend_s: Optional[float] = None, discovery: Optional[DiscoveryGrace] = None) -> Any:
    """Call ``client`` and wait for its response: ServiceUnavailable when the server is not
    there within ``server_wait_s``, ServiceTimeout (the request dropped) after ``call_timeout_s``
    (at least ``discovery``'s grace until the server has answered this client:
    ``capsule_ros.ros.discovery``).

    ``resend_s`` (idempotent queries only): send the request again when no response came
    within that long. A server that has only just been discovered can miss a request (its
    reply path to this client not yet matched); a query may safely ask twice."""
    discovery = discovery if discovery is not None else DiscoveryGrace(0.0)
    if not client.service_is_ready():
        discovery.on_server_gone()
        if not client.wait_for_service(timeout_sec=server_wait_s):
            raise ServiceUnavailable(f"{client.srv_name} not available after {server_wait_s:.1f} s")
    timeout_s = discovery.timeout_s(call_timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _f, done=done: done.set())
        left = deadline - time.monotonic()
        if done.wait(left if resend_s is None else min(resend_s, max(left, 0.0))):
            discovery.on_answer()
            return future.result()
        client.remove_pending_request(future)
        if time.monotonic() >= deadline:
            raise ServiceTimeout(f"{client.srv_name}: no response within {timeout_s * 1e3:.0f} ms"
                                 f"{DiscoveryGrace.note(timeout_s, call_timeout_s)}")


class LifecycleClient:
    """The standard lifecycle services of a managed node such as ``policy_node``
    (``~/get_state``, ``~/change_state``), as ``ros2 lifecycle`` uses them."""

    def __init__(self, node: Node, node_path: str = "/capsule_policy", *, server_wait_s: float = 5.0,
                 call_timeout_s: float = 60.0):
        from lifecycle_msgs.srv import ChangeState, GetState
        self.node, self.node_path = node, node_path.rstrip("/")
        self.server_wait_s, self.call_timeout_s = server_wait_s, call_timeout_s
        self._get: Any = node.create_client(GetState, f"{self.node_path}/get_state", qos_profile=service_qos())
        self._change: Any = node.create_client(ChangeState, f"{self.node_path}/change_state",
                                               qos_profile=service_qos())

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
    """Calls the services of one policy node (``node_path`` like "/capsule_policy"): one
    method per verb of ``capsule_ros.serving.verbs``, built from the table, named after the
    verb: ``commit(label="x", persist=True)``, ``reenter(capsule_id)``, ``list()``,
    ``drop(capsule_id, from_disk=True)``, ``record(True, path)``. Positional arguments
    follow the ``.srv`` request's field order, keywords its field names; every call also
    takes ``server_wait_s``, ``call_timeout_s`` and ``check`` (raise ServiceRefused on
    ``success=false``, default True) and returns the response. An idempotent verb's request
    is sent again when no answer came (``QUERY_RESEND_S``; the table says which are)."""

    OPTIONS = ("server_wait_s", "call_timeout_s", "check")

    def __init__(self, node: Node, node_path: str = "/capsule_policy", *, server_wait_s: float = 5.0,
                 call_timeout_s: float = 2.0):
        self.node = node
        self.node_path = node_path.rstrip("/")
        self.server_wait_s = server_wait_s
        self.call_timeout_s = call_timeout_s
        self._clients: Dict[str, Any] = {v.name: node.create_client(srv_type(v), f"{self.node_path}/{v.service}",
                                                                    qos_profile=service_qos())
                                         for v in VERBS}
        self._discovery = {name: DiscoveryGrace() for name in self._clients}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """``client.<verb>(...)`` (see the class docstring)."""
        found = BY_NAME.get(name)
        if found is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (the verbs: "
                                 f"{[v.name for v in VERBS]})")
        return functools.partial(self.invoke, found)

    def __dir__(self) -> List[str]:
        return sorted(set(super().__dir__()) | set(BY_NAME))

    def invoke(self, verb: Verb, *args: Any, **kwargs: Any) -> Any:
        """Call ``verb`` with the request built from ``args`` / ``kwargs`` (the class docstring)."""
        options = {key: kwargs.pop(key) for key in self.OPTIONS if key in kwargs}
        return self.call(verb.service, self.request(verb, *args, **kwargs), **options)

    @staticmethod
    def request(verb: Verb, *args: Any, **fields: Any) -> Any:
        """The verb's request: positional values in the ``.srv`` field order, then fields by
        name; TypeError for too many values or an unknown field."""
        request_type = srv_type(verb).Request
        names = list(request_type.get_fields_and_field_types())
        if len(args) > len(names):
            raise TypeError(f"{verb.name}() takes at most {len(names)} request values {names}, got {len(args)}")
        values = dict(zip(names, args, strict=False))          # fewer values than fields: the rest by name
        unknown = sorted(set(fields) - set(names))
        twice = sorted(set(fields) & set(values))
        if unknown or twice:
            raise TypeError(f"{verb.name}(): " + (f"unknown field(s) {unknown} (the request has {names})" if unknown
                                                  else f"field(s) {twice} given twice"))
        values.update(fields)
        return request_type(**values)

    def call(self, service: str, request: Any = None, *, server_wait_s: Optional[float] = None,
             call_timeout_s: Optional[float] = None, check: bool = True) -> Any:
        """Call a verb's service by the service's (``list_capsules``) or the verb's
        (``list``) name; returns the response (raises ServiceRefused on success=false when
        ``check``)."""
        found = find_verb(service)
        client = self._clients[found.name]
        response = call_service(client, request if request is not None else srv_type(found).Request(),
                                self.server_wait_s if server_wait_s is None else server_wait_s,
                                self.call_timeout_s if call_timeout_s is None else call_timeout_s,
                                resend_s=QUERY_RESEND_S if found.idempotent else None,
                                discovery=self._discovery[found.name])
        if check and not response.success:
            raise ServiceRefused(client.srv_name, response.error_code, response.message)
        return response

    def ready(self) -> bool:
        """Every service of the node is available now."""
        return all(client.service_is_ready() for client in self._clients.values())

    def destroy(self) -> None:
        for client in self._clients.values():
            self.node.destroy_client(client)
