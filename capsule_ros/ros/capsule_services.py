"""The policy node's capsule services (~/commit, ~/reset, ... ~/record), built from the
verb table (``capsule_ros.serving.verbs``): one service per verb, whose request's fields
go by name to the method that serves it (the session's, through the node's facade), run
on a service thread (see ros/node.py for why). Every call answers success / message /
error_code and the result's fields, and never raises; an answer the middleware dropped
for a client it had not finished discovering is sent again (``capsule_ros.ros.replies``)."""
from __future__ import annotations

from typing import Any, Callable, List

from rclpy.node import Node

from capsule_ros.errors import CapsuleRosError, ErrorCode
from capsule_ros.ros.facade import NodeFacade
from capsule_ros.ros.messages import fill_response, request_fields, service_qos, srv_type
from capsule_ros.ros.replies import LateReplies
from capsule_ros.ros.spinning import Offload
from capsule_ros.serving.files import SaveFailed
from capsule_ros.serving.verbs import VERBS, Verb


class CapsuleServices:
    """Creates the services on ``node`` and answers them through ``facade`` (WRONG_STATE
    unless the node is active)."""

    def __init__(self, node: Node, facade: NodeFacade, offload: Offload, callback_group: Any):
        self._facade = facade
        self._offload = offload
        replies = LateReplies(facade.logger)          # a just-discovered client's answer is not lost
        self.services: List[Any] = [replies.keep(node.create_service(srv_type(verb), f"~/{verb.service}",
                                                                     self._callback(verb), qos_profile=service_qos(),
                                                                     callback_group=callback_group))
                                    for verb in VERBS]

    def _callback(self, verb: Verb) -> Callable[[Any, Any], Any]:
        async def callback(request: Any, response: Any) -> Any:
            return await self._offload.run(self.answer, verb, request, response)
        return callback

    def answer(self, verb: Verb, request: Any, response: Any) -> Any:
        """Serve one request (on a service thread): the verb's result, or its typed error."""
        fields = request_fields(request)
        try:
            result = self._facade.handler(verb)(**fields)
            fill_response(response, result)
            response.message = verb.describe(result, fields) or "ok"
            response.success, response.error_code = True, int(ErrorCode.OK)
        except CapsuleRosError as exc:
            if isinstance(exc, SaveFailed):        # committed in memory: say which capsule
                fill_response(response, exc.capsule)
            response.success, response.error_code, response.message = False, int(exc.code), str(exc)
        except Exception as exc:  # noqa: BLE001 - answer INTERNAL, keep serving
            self._facade.logger.error(f"{verb.service} failed: {exc!r}")
            response.success, response.error_code = False, int(ErrorCode.INTERNAL)
            response.message = f"internal error ({type(exc).__name__}: {exc}); the live state is unchanged"
        return response
