"""What the policy node's two servers (``capsule_ros.ros.capsule_services`` and
``capsule_ros.ros.run_policy``) may use of the node: a narrow facade.

They get the session while the node is active (WRONG_STATE otherwise), the callable that
serves a verb of ``capsule_ros.serving.verbs``, the recording, and the last published
action; nothing else of the node. The node (``capsule_ros.ros.node``) builds the facade
and keeps it current across its lifecycle transitions, so the servers never import or
hold the node, and ``ros/`` has no import circle.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from capsule_ros.errors import WrongState
from capsule_ros.msg import Action
from capsule_ros.ros.publishing import ActionOutput, NodeRecording
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.records import RecordResult
from capsule_ros.serving.session import PolicySession
from capsule_ros.serving.verbs import Verb


class NodeFacade:
    """See the module docstring. The node sets ``session``, ``config``, ``active`` and
    ``lifecycle_state`` as its transitions run (on the executor's thread)."""

    def __init__(self, logger: Any, actions: ActionOutput, recording: NodeRecording):
        self.logger = logger
        self.session: Optional[PolicySession] = None
        self.config: Optional[ServingConfig] = None
        self.active = False
        self.lifecycle_state = "unconfigured"
        self._actions = actions
        self._recording = recording

    def active_session(self) -> PolicySession:
        """The session, when the node is active; else WRONG_STATE. (A check made before the
        boundary: the session's boundary refuses a verb that reaches it after a deactivate.)"""
        session = self.session
        if not self.active or session is None:
            raise WrongState(self.refusal())
        return session

    def refusal(self, lifecycle_state: str = "") -> str:
        """What a capsule service or goal answers while the node is ``lifecycle_state``
        (default: its state now)."""
        return (f"the node is {lifecycle_state or self.lifecycle_state}, not active: capsule services and goals "
                "are answered once it is activated (lifecycle ~/change_state)")

    def handler(self, verb: Verb) -> Callable[..., Any]:
        """What serves ``verb`` now: the active session's verb of its name
        (``PolicySession.verbs``), or the node's own (``record``). WRONG_STATE unless active."""
        if verb.session:
            return getattr(self.active_session().verbs, verb.name)
        self.active_session()
        return getattr(self, verb.name)

    def record(self, start: bool, path: str = "", storage: str = "") -> RecordResult:
        """``~/record``: start a recording (stopping a running one first) or stop it."""
        session = self.active_session()
        if not start:
            return self._recording.stop()
        assert self.config is not None
        bag = self._recording.start(self.config, session.status().fingerprint, path, storage)
        return RecordResult(str(bag))

    @property
    def last_action(self) -> Optional[Action]:
        """The last message published on ~/action (None before the first)."""
        return self._actions.last
