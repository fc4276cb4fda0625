"""The policy node's capsule services (~/commit, ~/reset, ... ~/record): each request
becomes one session verb, run on a service thread (see ros/node.py for why), and every
call answers success / message / error_code, never raises."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from capsule_ros import srv
from capsule_ros.errors import CapsuleRosError, ErrorCode, WrongState
from capsule_ros.ros.messages import capsule_info
from capsule_ros.ros.spinning import Offload
from capsule_ros.serving.files import SaveFailed
from capsule_ros.serving.records import HoldMode
from capsule_ros.serving.session import PolicySession

if TYPE_CHECKING:
    from capsule_ros.ros.node import PolicyNode

Handler = Callable[[Any, Any], str]


class CapsuleServices:
    """Creates the services on ``node`` and answers them while the node is active."""

    def __init__(self, node: PolicyNode, offload: Offload, callback_group):
        self.node = node
        self._offload = offload
        table = (
            (srv.Commit, "commit", self.commit), (srv.Reset, "reset", self.reset),
            (srv.Interrupt, "interrupt", self.interrupt), (srv.Reenter, "reenter", self.reenter),
            (srv.Fork, "fork", self.fork), (srv.ListCapsules, "list_capsules", self.list_capsules),
            (srv.DropCapsule, "drop_capsule", self.drop_capsule), (srv.SaveCapsule, "save_capsule", self.save_capsule),
            (srv.LoadCapsule, "load_capsule", self.load_capsule), (srv.Record, "record", self.record),
        )
        self.services = [node.create_service(srv_type, f"~/{name}", self._callback(handler),
                                             callback_group=callback_group)
                         for srv_type, name, handler in table]

    def _callback(self, handler: Handler):
        async def callback(request, response):
            return await self._offload.run(self._answer, handler, request, response)
        return callback

    def _answer(self, handler: Handler, request, response):
        try:
            response.message = handler(request, response) or "ok"
            response.success, response.error_code = True, int(ErrorCode.OK)
        except CapsuleRosError as exc:
            response.success, response.error_code, response.message = False, int(exc.code), str(exc)
        except Exception as exc:  # noqa: BLE001 - answer INTERNAL, keep serving
            self.node.get_logger().error(f"{handler.__name__} failed: {exc!r}")
            response.success, response.error_code = False, int(ErrorCode.INTERNAL)
            response.message = f"internal error ({type(exc).__name__}: {exc}); the live state is unchanged"
        return response

    @property
    def session(self) -> PolicySession:
        """The live session; WRONG_STATE unless the node is active."""
        return self.node.active_session()

    # -- handlers ----------------------------------------------------------------------------------
    def commit(self, req, resp) -> str:
        try:
            capsule = self.session.commit(req.label, req.persist, req.pin)
        except SaveFailed as exc:                  # committed in memory: say which capsule
            resp.capsule = capsule_info(exc.capsule)
            raise
        resp.capsule = capsule_info(capsule)
        return f"committed {capsule.id} at step {capsule.step}" + (f", saved to {capsule.path}" if req.persist else "")

    def reset(self, req, resp) -> str:
        episode, source = self.session.reset(req.capsule_id)
        resp.episode_id = episode
        if source is not None:
            resp.capsule = capsule_info(source)
        return f"episode {episode} started from " + (f"capsule {source.id}" if source else "the initial state")

    def interrupt(self, req, resp) -> str:
        session = self.session
        capsule = self.node.interrupt(req.hold_mode, req.commit)
        if capsule is not None:
            resp.capsule = capsule_info(capsule)
        return f"interrupted at step {session.step} ({HoldMode(req.hold_mode).name})" + (
            f", boundary capsule {capsule.id}" if capsule else "")

    def reenter(self, req, resp) -> str:
        session = self.session
        result = session.reenter(req.capsule_id)
        if result.capsule is not None:
            resp.capsule = capsule_info(result.capsule)
        resp.rollback, resp.fallback, resp.fallback_reason = result.rollback, result.fallback, result.fallback_reason
        resp.restore_ms, resp.recompute_ms = result.restore_seconds * 1e3, result.recompute_seconds * 1e3
        if result.capsule is None:
            return f"resumed at step {session.step}"
        verb = "rolled back to" if result.rollback else "re-entered"
        return f"{verb} {result.capsule.id} (episode {result.capsule.episode_id}, step {result.capsule.step})" + (
            f" by recomputation: {result.fallback_reason}" if result.fallback else "")

    def fork(self, req, resp) -> str:
        capsule = self.session.fork(req.capsule_id, req.label)
        resp.capsule = capsule_info(capsule)
        return f"forked {capsule.id} from {capsule.parent_id or 'the live state'}"

    def list_capsules(self, req, resp) -> str:
        capsules = self.session.list_capsules(req.current_episode_only)
        resp.capsules = [capsule_info(c) for c in capsules]
        return f"{len(capsules)} capsule(s)"

    def drop_capsule(self, req, resp) -> str:
        self.session.drop(req.capsule_id, req.from_disk)
        return f"dropped {req.capsule_id}"

    def save_capsule(self, req, resp) -> str:
        capsule = self.session.save(req.capsule_id)
        resp.capsule, resp.path = capsule_info(capsule), capsule.path or ""
        return f"saved {capsule.id} to {capsule.path}"

    def load_capsule(self, req, resp) -> str:
        capsule = self.session.load(req.capsule_id)
        resp.capsule = capsule_info(capsule)
        return f"loaded {capsule.id} (episode {capsule.episode_id}, step {capsule.step})"

    def record(self, req, resp) -> str:
        self.session                               # noqa: B018 - WRONG_STATE unless active
        if req.start:
            path = self.node.start_recording(req.path, req.storage)
            resp.bag_path = str(path)
            return f"recording to {path}"
        if self.node.recorder is None:
            raise WrongState("not recording")
        path, count = self.node.stop_recording()
        resp.bag_path, resp.messages = str(path), count
        return f"wrote {count} messages to {path}"
