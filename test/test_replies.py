"""``LateReplies`` (capsule_ros/ros/replies.py): an answer the middleware dropped, because
the server had not yet matched the client's reply reader, is sent again until it arrives;
one that can never arrive is given up on with a warning, and the server keeps serving.

Real rclpy nodes, a real service and client on Fast DDS. The never-matching reader is a
client whose reply QoS the server's writer cannot serve (transient-local against
volatile), which makes rmw_fastrtps drop every answer to it exactly as it drops one to a
client still being discovered. A late match cannot be produced on demand, so the second
test lets rclpy's own drop warning stand for the first two sends, then sends for real."""
from __future__ import annotations

import threading
import time
import warnings

import pytest

pytestmark = pytest.mark.ros


class Log:
    """What the late replies said, by level."""

    def __init__(self):
        self.lines = {"info": [], "warning": []}

    def info(self, text: str) -> None:
        self.lines["info"].append(text)

    def warning(self, text: str) -> None:
        self.lines["warning"].append(text)


@pytest.fixture
def nodes(rclpy_context):
    from rclpy.executors import MultiThreadedExecutor
    server = rclpy_context.create_node("late_replies_server")
    client = rclpy_context.create_node("late_replies_client")
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(server)
    executor.add_node(client)
    spinning = threading.Thread(target=executor.spin, daemon=True)
    spinning.start()
    yield server, client
    executor.shutdown()
    server.destroy_node()
    client.destroy_node()


def serve(server, name: str, log: Log, dropped: int = 0, **options):
    """A Trigger service kept by ``LateReplies``; its answers' calls and, beneath the late
    replies, every send (the first ``dropped`` sends say what rclpy says when rmw drops
    the answer, and send nothing)."""
    from std_srvs.srv import Trigger

    from capsule_ros.ros.replies import LateReplies
    calls, sends = [], []

    def answer(request, response):
        calls.append(time.monotonic())
        response.success, response.message = True, f"answer {len(calls)}"
        return response
    service = server.create_service(Trigger, name, answer)
    send = service.send_response

    def counted(response, header):
        sends.append(time.monotonic())
        if len(sends) <= dropped:
            warnings.warn("failed to send response (timeout): client will not receive response", RuntimeWarning,
                          stacklevel=1)
            return
        send(response, header)
    service.send_response = counted
    LateReplies(log, **options).keep(service)
    return calls, sends


def wait(future, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return future.done()


def test_an_answer_that_can_never_arrive_is_given_up_and_the_server_keeps_serving(nodes):
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_srvs.srv import Trigger
    server, client = nodes
    log = Log()
    serve(server, "late_replies_never", log, retry_every_s=0.05, retry_for_s=0.5)
    unreachable = client.create_client(Trigger, "late_replies_never", qos_profile=QoSProfile(
        depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
    future = unreachable.call_async(Trigger.Request())     # its reply reader never matches the server's writer
    deadline = time.monotonic() + 10.0
    while not log.lines["warning"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.lines["warning"] and "not discovered within" in log.lines["warning"][0], log.lines
    assert not future.done() and not log.lines["info"]
    ordinary = client.create_client(Trigger, "late_replies_never")
    assert ordinary.wait_for_service(timeout_sec=10.0)
    again = ordinary.call_async(Trigger.Request())
    assert wait(again, 10.0) and again.result().success and again.result().message == "answer 2"


def test_a_dropped_answer_is_sent_again_until_it_arrives(nodes):
    from std_srvs.srv import Trigger
    server, client = nodes
    log = Log()
    calls, sends = serve(server, "late_replies_late", log, dropped=2, retry_every_s=0.05, retry_for_s=5.0)
    caller = client.create_client(Trigger, "late_replies_late")
    assert caller.wait_for_service(timeout_sec=10.0)
    future = caller.call_async(Trigger.Request())
    assert wait(future, 10.0), (sends, log.lines)
    assert future.result().success and future.result().message == "answer 1"
    assert len(calls) == 1 and len(sends) == 3          # answered once, sent three times
    assert log.lines["info"] and "answered on attempt 3" in log.lines["info"][0], log.lines
    assert not log.lines["warning"]
