"""py_trees leaves that call the policy node's capsule services without blocking a tick.

One generic leaf, :class:`CapsuleServiceCall`, does the work; the per-verb classes
(:class:`Commit`, :class:`Reenter`, :class:`Reset`, :class:`Interrupt`, :class:`Fork`,
:class:`DropCapsule`, :class:`SaveCapsule`, :class:`LoadCapsule`) only say how to build
their request from the blackboard and what to write back.

Lifecycle of one execution of a leaf (``initialise`` then ``update`` on each tick):

1. ``initialise`` builds the request. A request that cannot be built (a blackboard key is
   missing, a capsule id is malformed) fails the leaf on its first tick with
   ``INVALID_REQUEST``; nothing is sent.
2. While the server is not discovered the leaf stays RUNNING, for at most
   ``server_wait_s`` since ``initialise``; then it fails with ``SERVICE_UNREACHABLE``.
   (``server_wait_s=0``: fail on the first tick the server is missing, which is what
   BehaviorTree.ROS2's ``RosServiceNode`` does at tick time.)
3. Once the server is there the request is sent with ``call_async`` and the leaf stays
   RUNNING until the response arrives. No response within ``call_timeout_s`` of sending:
   the pending request is dropped (a late answer is ignored) and the leaf fails with
   ``SERVICE_TIMEOUT``. The leaf's first call to a server, and its first after it found
   the server gone, waits at least ``discovery_grace_s`` (5 s): a just-started node may
   not have discovered the tree's process yet and answers once it has
   (``capsule_ros.ros.discovery``).
4. A response with ``success=false`` fails the leaf with ``SERVICE_ABORTED``; the server's
   ``error_code`` and ``message`` are kept. ``success=true``: the leaf writes its results
   (e.g. the committed capsule id) to the blackboard and succeeds.

The failure kinds are BehaviorTree.ROS2's ``ServiceNodeErrorCode`` names, so a py_trees
tree and a C++ tree report the same thing. Every outcome, good or bad, is written as a
:class:`ServiceOutcome` to the leaf's ``outcome_key`` (default
``/capsule/outcome/<service>``) and summarised in ``feedback_message``; the leaf's
``outcome`` attribute holds the last one too.

A tick never blocks: the leaf only polls ``service_is_ready()`` and the response future.
Something else must spin the rclpy node the leaves were set up with so that responses
arrive: an executor in a background thread (:func:`spin_in_background`), or the tick loop
itself (``executor.spin_once(timeout_sec=0)`` between ticks). Each leaf creates its one
rclpy client at set-up and reuses it for every call (never a client per call).

Set-up: pass the rclpy node to the constructor (``node=``) or to ``setup`` /
``BehaviourTree.setup(node=...)`` (the py_trees_ros convention).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

import py_trees
from py_trees.common import Access, Status

from capsule_ros import srv
from capsule_ros.capsules.ids import check_capsule_id
from capsule_ros.errors import ErrorCode
from capsule_ros.ros.discovery import DISCOVERY_GRACE_S, DiscoveryGrace
from capsule_ros.ros.messages import service_qos, srv_type
from capsule_ros.ros.spinning import SpinThread
from capsule_ros.serving.verbs import Verb, find_verb

DEFAULT_NODE = "/capsule_policy"
LAST_GOOD_KEY = "/capsule/last_good"          # Commit writes, Reenter / Fork / Reset read
INTERRUPT_KEY = "/capsule/interrupt"          # Interrupt writes the boundary capsule's id
FORK_KEY = "/capsule/fork"                    # Fork writes the new capsule's id
OUTCOME_PREFIX = "/capsule/outcome"           # + "/<service>": the last ServiceOutcome

# Defaults. The node's answers are meant to take milliseconds (the target is a p99 of
# 20 ms: docs/benchmarks.md, "Services"), but it may take up to its
# control.service_timeout_ms (500 ms by default) waiting for a step boundary before it
# answers BUSY. A client that gives up sooner can report SERVICE_TIMEOUT for a call the node
# then applies (a late commit, reset or re-entry), so the call timeout sits above that
# bound: 1 s, BehaviorTree.ROS2's default server_timeout. Normal answers still take
# milliseconds: the timeout only bounds the failure case. Calls that touch the disk
# (commit with persist, save, load) get 5 s.
DEFAULT_SERVER_WAIT_S = 1.0
DEFAULT_CALL_TIMEOUT_S = 1.0
DISK_CALL_TIMEOUT_S = 5.0

RequestFactory = Callable[[py_trees.blackboard.Client], Any]
ResultWriter = Callable[[Any], Any]


class FailureKind(str, enum.Enum):
    """Why a leaf failed: BehaviorTree.ROS2's ``BT::ServiceNodeErrorCode`` names."""

    SERVICE_UNREACHABLE = "SERVICE_UNREACHABLE"   # server not discovered within server_wait_s
    SERVICE_TIMEOUT = "SERVICE_TIMEOUT"           # no response within the call's timeout of sending
    INVALID_REQUEST = "INVALID_REQUEST"           # the request could not be built; nothing sent
    SERVICE_ABORTED = "SERVICE_ABORTED"           # the server answered success=false (see error_code)


class InvalidRequest(ValueError):
    """Raised by a request factory when the request cannot be built (-> INVALID_REQUEST)."""


@dataclass(frozen=True)
class ServiceOutcome:
    """How one call of a leaf ended (written to the blackboard at ``outcome_key``)."""

    service: str                       # fully qualified service name
    success: bool
    failure: Optional[FailureKind]     # None on success
    error_code: Optional[int]          # the server's error_code when it answered, else None
    message: str                       # the server's message, or the client-side reason
    elapsed_s: float                   # from initialise to the end of the call
    response: Any = field(default=None, repr=False, compare=False)

    @property
    def error_name(self) -> str:
        """``NOT_FOUND``-style name of ``error_code`` ("" when the server did not answer)."""
        if self.error_code is None:
            return ""
        try:
            return ErrorCode(self.error_code).name
        except ValueError:
            return str(self.error_code)

    def __str__(self) -> str:
        if self.success:
            return f"{self.service}: ok: {self.message}"
        code = f": {self.error_name}" if self.error_code is not None else ""
        failure = self.failure.value if self.failure is not None else "FAILED"
        return f"{self.service}: {failure}{code}: {self.message}"


# -- spinning -----------------------------------------------------------------------------------
def spin_in_background(node) -> SpinThread:
    """Spin ``node`` in a daemon thread; call ``shutdown()`` on the result when done."""
    return SpinThread(node, name="capsule-bt-spin")


# -- the generic leaf -------------------------------------------------------------------------
class CapsuleServiceCall(py_trees.behaviour.Behaviour):
    """Call one service of a policy node asynchronously (see the module docstring).

    Args:
        name: the behaviour's name.
        service: the service's short name ("commit", "reenter", "list_capsules", ...) or
            its verb's name ("list", "drop"): a row of ``capsule_ros.serving.verbs``.
        request: a factory ``f(blackboard_client) -> Request`` called in ``initialise``
            (raise :class:`InvalidRequest`, ``KeyError`` or ``ValueError`` to refuse), a
            ready request, or None for an empty request.
        node_path: the policy node, e.g. "/capsule_policy" or "/robot1/capsule_policy".
        reads: blackboard keys the factory reads (registered for READ access).
        results: blackboard key -> ``f(response)``: what to write on success.
        outcome_key: where the :class:`ServiceOutcome` goes (default
            ``/capsule/outcome/<service>``; "" for nowhere).
        server_wait_s: how long to wait for the server to be discovered (SERVICE_UNREACHABLE).
        call_timeout_s: how long to wait for the response once sent (SERVICE_TIMEOUT).
        discovery_grace_s: the least a first call to a just-discovered server waits.
        node: the rclpy node to create clients on (or give it to ``setup(node=...)``).
    """

    def __init__(self, name: str, service: str, request: Any = None, *, node_path: str = DEFAULT_NODE,
                 reads: Iterable[str] = (), results: Optional[Mapping[str, ResultWriter]] = None,
                 outcome_key: Optional[str] = None, server_wait_s: float = DEFAULT_SERVER_WAIT_S,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, discovery_grace_s: float = DISCOVERY_GRACE_S,
                 node=None):
        super().__init__(name=name)
        try:
            self.verb: Verb = find_verb(service)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        service = self.verb.service
        if server_wait_s < 0 or call_timeout_s < 0:
            raise ValueError(f"timeouts must be >= 0 (server_wait_s={server_wait_s}, call_timeout_s={call_timeout_s})")
        self.service = service
        self.node_path = node_path.rstrip("/")
        self.service_name = f"{self.node_path}/{service}"
        self.server_wait_s = float(server_wait_s)
        self.call_timeout_s = float(call_timeout_s)
        self.discovery = DiscoveryGrace(discovery_grace_s)
        self._factory: RequestFactory = self._as_factory(request, srv_type(self.verb))
        self.results: Dict[str, ResultWriter] = dict(results or {})
        self.outcome_key = f"{OUTCOME_PREFIX}/{service}" if outcome_key is None else outcome_key
        self.blackboard = self.attach_blackboard_client(name=name)
        for key in reads:
            self.blackboard.register_key(key=key, access=Access.READ)
        for key in list(self.results) + ([self.outcome_key] if self.outcome_key else []):
            self.blackboard.register_key(key=key, access=Access.WRITE)
        self._node = node
        self._client: Any = None
        self.outcome: Optional[ServiceOutcome] = None
        self._reset_call()

    @staticmethod
    def _as_factory(request: Any, srv_type) -> RequestFactory:
        if request is None:
            return lambda _bb: srv_type.Request()
        if callable(request):
            return request
        if not isinstance(request, srv_type.Request):
            raise TypeError(f"request {request!r}: expected a {srv_type.__name__}.Request or a factory")
        return lambda _bb: request

    def _reset_call(self) -> None:
        self._request = None
        self._invalid: Optional[str] = None
        self._future: Any = None
        self._started = time.monotonic()
        self._sent_at: Optional[float] = None
        self._timeout_s = self.call_timeout_s

    # -- py_trees lifecycle ------------------------------------------------------------------------
    def setup(self, **kwargs: Any) -> None:
        """Create this leaf's one rclpy client (at set-up, never per call); ``node`` from the
        kwargs or the constructor."""
        node = kwargs.get("node", self._node)
        if node is None:
            raise KeyError(f"{self.name}: no rclpy node: pass node= to the constructor or to setup()")
        if self._client is None or self._node is not node:
            self._node = node
            self._client = node.create_client(srv_type(self.verb), f"{self.node_path.rstrip('/')}/{self.service}",
                                              qos_profile=service_qos())
            self.discovery.on_server_gone()            # a new client: the server has not seen it yet

    def initialise(self) -> None:
        self._reset_call()
        self.outcome = None
        try:
            self._request = self._factory(self.blackboard)
        except KeyError as exc:
            self._invalid = f"missing blackboard key: {exc.args[0] if exc.args else exc}"
        except (InvalidRequest, ValueError, TypeError) as exc:
            self._invalid = str(exc)
        self.feedback_message = "building request" if self._invalid is None else self._invalid

    def update(self) -> Status:
        if self._client is None:
            raise RuntimeError(f"{self.name}: setup() was not called")
        now = time.monotonic()
        if self._invalid is not None:
            return self._finish(FailureKind.INVALID_REQUEST, None, self._invalid)
        if self._future is None:
            if self._client.service_is_ready():
                self._future = self._client.call_async(self._request)
                self._sent_at = now
                self._timeout_s = self.discovery.timeout_s(self.call_timeout_s)
                self.feedback_message = f"called {self.service_name}"
                return Status.RUNNING
            self.discovery.on_server_gone()
            waited = now - self._started
            if waited >= self.server_wait_s:
                return self._finish(FailureKind.SERVICE_UNREACHABLE, None,
                                    f"{self.service_name} not available after {waited * 1e3:.0f} ms")
            self.feedback_message = f"waiting for {self.service_name}"
            return Status.RUNNING
        if self._future.done():
            return self._on_done()
        waited = now - (self._sent_at if self._sent_at is not None else now)
        if waited > self._timeout_s:
            self._drop_pending()
            return self._finish(FailureKind.SERVICE_TIMEOUT, None,
                                f"no response within {self._timeout_s * 1e3:.0f} ms "
                                f"(waited {waited * 1e3:.0f} ms)"
                                f"{DiscoveryGrace.note(self._timeout_s, self.call_timeout_s)}")
        return Status.RUNNING

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID:   # interrupted by a parent: forget the call in flight
            self._drop_pending()
            self.feedback_message = "cancelled"

    # -- results -----------------------------------------------------------------------------------
    def _on_done(self) -> Status:
        future, self._future = self._future, None
        exc = future.exception() if not future.cancelled() else None
        response = None if future.cancelled() or exc is not None else future.result()
        if response is not None:
            self.discovery.on_answer()
        if response is None:
            reason = "cancelled" if future.cancelled() else f"the call raised {exc!r}" if exc else "empty response"
            return self._finish(FailureKind.SERVICE_ABORTED, None, reason)
        if not response.success:
            return self._finish(FailureKind.SERVICE_ABORTED, int(response.error_code), response.message, response)
        try:
            for key, writer in self.results.items():
                self.blackboard.set(key, writer(response))
        except Exception as exc:  # noqa: BLE001 - a bad result writer is the tree's bug: say so, fail
            return self._finish(FailureKind.SERVICE_ABORTED, int(response.error_code),
                                f"{response.message}; writing the results failed: {exc!r}", response)
        return self._finish(None, int(response.error_code), response.message, response)

    def _finish(self, failure: Optional[FailureKind], error_code: Optional[int], message: str,
                response: Any = None) -> Status:
        self.outcome = ServiceOutcome(self.service_name, failure is None, failure, error_code, message,
                                      time.monotonic() - self._started, response)
        if self.outcome_key:
            self.blackboard.set(self.outcome_key, self.outcome)
        self.feedback_message = str(self.outcome)
        if failure is not None:
            self.logger.warning(str(self.outcome))
        return Status.SUCCESS if failure is None else Status.FAILURE

    def _drop_pending(self) -> None:
        if self._future is not None and not self._future.done() and self._client is not None:
            self._client.remove_pending_request(self._future)
        self._future = None


# -- request helpers ---------------------------------------------------------------------------
def capsule_id_from(blackboard, capsule_id: Optional[str], capsule_key: Optional[str], *, allow_empty: bool,
                    what: str = "capsule id") -> str:
    """The capsule id for a request: the literal ``capsule_id`` if given, else the value at
    ``capsule_key`` (InvalidRequest if unset), else "". Validated against the id alphabet
    (InvalidRequest when malformed, or when empty and ``allow_empty`` is False)."""
    if capsule_id is None and capsule_key and not blackboard.exists(capsule_key):
        raise InvalidRequest(f"missing blackboard key {capsule_key!r} (no {what} to use)")
    value = capsule_id if capsule_id is not None else (blackboard.get(capsule_key) if capsule_key else "")
    source = f"blackboard {capsule_key!r}" if capsule_id is None and capsule_key else "argument"
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} from {source} must be a string, got {value!r}")
    if value == "":
        if allow_empty:
            return ""
        raise InvalidRequest(f"{what} from {source} is empty")
    try:
        return check_capsule_id(value)
    except ValueError as exc:
        raise InvalidRequest(f"{what} from {source}: {exc}") from None


def _capsule_results(capsule_key: Optional[str],
                     extra: Optional[Mapping[str, ResultWriter]]) -> Dict[str, ResultWriter]:
    out: Dict[str, ResultWriter] = {capsule_key: (lambda r: r.capsule.id)} if capsule_key else {}
    out.update(extra or {})
    return out


def _id_reads(capsule_id: Optional[str], capsule_key: Optional[str]) -> tuple:
    return (capsule_key,) if capsule_id is None and capsule_key else ()


# -- one thin class per verb -------------------------------------------------------------------
class Commit(CapsuleServiceCall):
    """``~/commit``: snapshot the state; the new capsule's id goes to ``capsule_key``
    (default: the "last good capsule" that Reenter reads)."""

    def __init__(self, name: str = "Commit", *, label: str = "", persist: bool = False, pin: bool = False,
                 capsule_key: Optional[str] = LAST_GOOD_KEY, results: Optional[Mapping[str, ResultWriter]] = None,
                 **kwargs: Any):
        if persist:
            kwargs.setdefault("call_timeout_s", DISK_CALL_TIMEOUT_S)
        super().__init__(name, "commit", lambda _bb: srv.Commit.Request(label=label, persist=persist, pin=pin),
                         results=_capsule_results(capsule_key, results), **kwargs)


class Reenter(CapsuleServiceCall):
    """``~/reenter``: restore a capsule and resume. The id is ``capsule_id`` if given, else
    the blackboard value at ``capsule_key`` (default: the last good capsule); with both None
    the request is empty: the interrupt capsule."""

    def __init__(self, name: str = "Reenter", *, capsule_key: Optional[str] = LAST_GOOD_KEY,
                 capsule_id: Optional[str] = None, **kwargs: Any):
        def request(bb):
            return srv.Reenter.Request(capsule_id=capsule_id_from(
                bb, capsule_id, capsule_key, allow_empty=capsule_id is not None or not capsule_key))
        super().__init__(name, "reenter", request, reads=_id_reads(capsule_id, capsule_key), **kwargs)


class Reset(CapsuleServiceCall):
    """``~/reset``: start a new episode from the initial state (default) or a capsule
    (``capsule_id`` / ``capsule_key``); the new episode id goes to ``episode_key`` if set."""

    def __init__(self, name: str = "Reset", *, capsule_key: Optional[str] = None, capsule_id: Optional[str] = None,
                 episode_key: Optional[str] = None, results: Optional[Mapping[str, ResultWriter]] = None,
                 **kwargs: Any):
        def request(bb):
            return srv.Reset.Request(capsule_id=capsule_id_from(
                bb, capsule_id, capsule_key, allow_empty=capsule_id is not None or not capsule_key))
        writers: Dict[str, ResultWriter] = {episode_key: (lambda r: r.episode_id)} if episode_key else {}
        writers.update(results or {})
        super().__init__(name, "reset", request, reads=_id_reads(capsule_id, capsule_key), results=writers, **kwargs)


class Interrupt(CapsuleServiceCall):
    """``~/interrupt``: stop acting at the boundary (``hold_mode``: Interrupt.Request.HOLD_*);
    with ``commit`` the boundary capsule's id goes to ``capsule_key``."""

    def __init__(self, name: str = "Interrupt", *, hold_mode: int = srv.Interrupt.Request.HOLD_LAST,
                 commit: bool = True, capsule_key: Optional[str] = INTERRUPT_KEY,
                 results: Optional[Mapping[str, ResultWriter]] = None, **kwargs: Any):
        super().__init__(name, "interrupt", lambda _bb: srv.Interrupt.Request(hold_mode=hold_mode, commit=commit),
                         results=_capsule_results(capsule_key if commit else None, results), **kwargs)


class Fork(CapsuleServiceCall):
    """``~/fork``: a new capsule id with the state of ``source_id`` / ``source_key``
    (default: the last good capsule; ``source_id=""``: the live state); the new id goes
    to ``capsule_key``."""

    def __init__(self, name: str = "Fork", *, source_key: Optional[str] = LAST_GOOD_KEY,
                 source_id: Optional[str] = None, label: str = "", capsule_key: Optional[str] = FORK_KEY,
                 results: Optional[Mapping[str, ResultWriter]] = None, **kwargs: Any):
        def request(bb):
            return srv.Fork.Request(label=label, capsule_id=capsule_id_from(
                bb, source_id, source_key, allow_empty=source_id is not None or not source_key, what="source id"))
        super().__init__(name, "fork", request, reads=_id_reads(source_id, source_key),
                         results=_capsule_results(capsule_key, results), **kwargs)


class _OneCapsuleCall(CapsuleServiceCall):
    """Verbs on one existing capsule (drop, save, load): the id must be given."""

    SERVICE = ""          # the verb's service (a row of capsule_ros.serving.verbs)

    def __init__(self, name: str, *, capsule_key: Optional[str] = LAST_GOOD_KEY, capsule_id: Optional[str] = None,
                 fields: Optional[Mapping[str, Any]] = None, **kwargs: Any):
        extra = dict(fields or {})
        request_type = srv_type(find_verb(self.SERVICE)).Request

        def request(bb):
            return request_type(capsule_id=capsule_id_from(bb, capsule_id, capsule_key, allow_empty=False), **extra)
        super().__init__(name, self.SERVICE, request, reads=_id_reads(capsule_id, capsule_key), **kwargs)


class DropCapsule(_OneCapsuleCall):
    """``~/drop_capsule`` of ``capsule_id`` / ``capsule_key`` (``from_disk`` deletes its file too)."""

    SERVICE = "drop_capsule"

    def __init__(self, name: str = "DropCapsule", *, from_disk: bool = False, **kwargs: Any):
        super().__init__(name, fields={"from_disk": from_disk}, **kwargs)


class SaveCapsule(_OneCapsuleCall):
    """``~/save_capsule`` of ``capsule_id`` / ``capsule_key`` to the capsule directory."""

    SERVICE = "save_capsule"

    def __init__(self, name: str = "SaveCapsule", **kwargs: Any):
        kwargs.setdefault("call_timeout_s", DISK_CALL_TIMEOUT_S)
        super().__init__(name, **kwargs)


class LoadCapsule(_OneCapsuleCall):
    """``~/load_capsule`` of ``capsule_id`` / ``capsule_key`` from the capsule directory."""

    SERVICE = "load_capsule"

    def __init__(self, name: str = "LoadCapsule", **kwargs: Any):
        kwargs.setdefault("call_timeout_s", DISK_CALL_TIMEOUT_S)
        super().__init__(name, **kwargs)


# -- running a tree ----------------------------------------------------------------------------
def tick_until_done(tree, *, period_s: float = 0.01, timeout_s: Optional[float] = None,
                    between_ticks: Optional[Callable[[], None]] = None) -> Status:
    """Tick ``tree`` (a BehaviourTree or a root behaviour) every ``period_s`` until its root
    is no longer RUNNING; returns the final status (RUNNING if ``timeout_s`` passed first).
    ``between_ticks`` runs after each tick (e.g. ``lambda: executor.spin_once(timeout_sec=0)``
    when no background executor spins the node)."""
    root = tree.root if isinstance(tree, py_trees.trees.BehaviourTree) else tree
    tick = tree.tick if isinstance(tree, py_trees.trees.BehaviourTree) else tree.tick_once
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        started = time.monotonic()
        tick()
        if root.status not in (Status.RUNNING, Status.INVALID):
            return root.status
        if between_ticks is not None:
            between_ticks()
        if deadline is not None and time.monotonic() >= deadline:
            return Status.RUNNING
        time.sleep(max(0.0, period_s - (time.monotonic() - started)))
