"""The py_trees client (capsule_ros.bt) against the real policy node.

Each failure kind of the service leaves is produced for real: SERVICE_UNREACHABLE (no
node of that name), SERVICE_TIMEOUT (the node's process is stopped with SIGSTOP while the
call is in flight), SERVICE_ABORTED with the server's exact error code (NOT_FOUND,
WRONG_STATE), INVALID_REQUEST (missing blackboard key, malformed id: nothing is sent).
The example tree's retry logic is checked through the node: its ~/capsule_events (one
REENTER of the committed capsule after each failed try) and its actions (each retry
replays bit-identically from the committed capsule).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import py_trees
import pytest
from harness import REPO, ClientNode, Driver, observations, restore_node, start_policy_node, unique_ns, wait_for
from py_trees.common import Status

import capsule_ros.bt as bt

pytestmark = pytest.mark.ros
NS = "/bt"
NODE = f"{NS}/capsule_policy"


@pytest.fixture(scope="module")
def shared(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("bt_node")
    proc = start_policy_node(tmp, {"policy": {"weights": ""}, "control": {"deadline_ms": 2000.0}}, namespace=NS)
    client = ClientNode(rclpy_context, "bt_test_client", node_path=NODE)
    driver = Driver(client, NS)
    driver.send_goal()
    yield proc, client, driver
    client.close()
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def env(shared):
    """The module's node, restored to a fresh node's state before each test (the trees
    commit, interrupt, re-enter and drop on it)."""
    proc, client, driver = shared
    restore_node(client, {})
    for q in (driver.actions, driver.events):
        ClientNode.drain(q)
    return shared


@pytest.fixture(autouse=True)
def clean_blackboard():
    py_trees.blackboard.Blackboard.clear()
    yield
    py_trees.blackboard.Blackboard.clear()


def run(root, client, timeout=20.0, period=0.005):
    """Set up and tick ``root`` until it is done; returns (status, ticks, seconds, longest tick)."""
    py_trees.trees.setup(root, node=client.node)
    ticks, longest, start = 0, 0.0, time.monotonic()
    while True:
        t0 = time.monotonic()
        root.tick_once()
        longest = max(longest, time.monotonic() - t0)
        ticks += 1
        if root.status != Status.RUNNING:
            return root.status, ticks, time.monotonic() - start, longest
        assert time.monotonic() - start < timeout, f"{root.name} still RUNNING after {timeout} s"
        time.sleep(period)


def bb(key):
    return py_trees.blackboard.Blackboard.get(key)


def events_of(driver, kind, timeout=5.0, count=1):
    """Wait for ``count`` capsule events of ``kind``; return all events seen of that kind."""
    seen = []

    def enough():
        seen.extend(e for e in ClientNode.drain(driver.events) if e.kind == kind)
        return len(seen) >= count
    wait_for(enough, timeout=timeout, what=f"{count} capsule event(s) of kind {kind}")
    return seen


# -- leaves -------------------------------------------------------------------------------------
def test_commit_success_stores_the_capsule_id(env):
    from capsule_ros.bt import LAST_GOOD_KEY, Commit
    from capsule_ros.msg import CapsuleEvent
    proc, client, driver = env
    driver.run(observations(3, 100))
    ClientNode.drain(driver.events)
    leaf = Commit(node_path=NODE, label="bt commit")
    status, ticks, seconds, longest = run(leaf, client)
    assert status == Status.SUCCESS, leaf.feedback_message
    capsule_id = bb(LAST_GOOD_KEY)
    outcome = bb("/capsule/outcome/commit")
    assert outcome.success and outcome.failure is None and outcome.error_code == 0
    assert outcome.response.capsule.id == capsule_id and outcome.response.capsule.label == "bt commit"
    assert ticks >= 2 and longest < 0.1           # sent on one tick, answered on a later one
    # the node has it
    event = events_of(driver, CapsuleEvent.COMMIT)[-1]
    assert event.capsule_id == capsule_id
    assert capsule_id in [c.id for c in client.capsules.list().capsules]


def test_unreachable_when_no_node_has_that_name(env):
    from capsule_ros.bt import LAST_GOOD_KEY, Commit, FailureKind
    proc, client, driver = env
    leaf = Commit(node_path="/no_such_ns/capsule_policy", server_wait_s=0.3)
    status, ticks, seconds, longest = run(leaf, client)
    assert status == Status.FAILURE
    assert leaf.outcome.failure == FailureKind.SERVICE_UNREACHABLE and leaf.outcome.error_code is None
    assert "SERVICE_UNREACHABLE" in leaf.feedback_message
    assert "/no_such_ns/capsule_policy/commit" in leaf.feedback_message
    assert 0.3 <= seconds < 2.0
    assert ticks > 10 and longest < 0.1           # waited for the server across ticks, never inside one
    assert not py_trees.blackboard.Blackboard.exists(LAST_GOOD_KEY)


def test_timeout_when_the_node_is_blocked_then_recovers(env):
    from capsule_ros.bt import CapsuleServiceCall, FailureKind
    proc, client, driver = env
    leaf = CapsuleServiceCall("ListWhileStopped", "list_capsules", node_path=NODE, call_timeout_s=0.25)
    status, *_ = run(leaf, client)             # discovered and answering
    assert status == Status.SUCCESS
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        status, ticks, seconds, longest = run(leaf, client)
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    assert status == Status.FAILURE, leaf.feedback_message
    assert leaf.outcome.failure == FailureKind.SERVICE_TIMEOUT and leaf.outcome.error_code is None
    assert 0.25 <= seconds < 2.0 and ticks > 10 and longest < 0.1
    assert bb("/capsule/outcome/list_capsules").failure == FailureKind.SERVICE_TIMEOUT
    # the node answers the dropped call late; the leaf ignores it and the next call succeeds
    status, *_ = run(leaf, client)
    assert status == Status.SUCCESS, leaf.feedback_message
    assert leaf.outcome.response.capsules is not None


def test_aborted_keeps_the_servers_error_code_not_found(env):
    from capsule_ros.bt import LAST_GOOD_KEY, FailureKind, Reenter
    from capsule_ros.errors import ErrorCode
    proc, client, driver = env
    py_trees.blackboard.Blackboard.set(LAST_GOOD_KEY, "no-such-capsule")
    lineage_before = driver.latest_status().lineage
    leaf = Reenter(node_path=NODE)
    status, *_ = run(leaf, client)
    assert status == Status.FAILURE
    outcome = bb("/capsule/outcome/reenter")
    assert outcome is leaf.outcome and outcome.failure == FailureKind.SERVICE_ABORTED
    assert outcome.error_code == ErrorCode.NOT_FOUND and outcome.error_name == "NOT_FOUND"
    assert "no-such-capsule" in outcome.message
    assert "SERVICE_ABORTED: NOT_FOUND" in leaf.feedback_message
    assert driver.latest_status().lineage == lineage_before       # refused: the live state is untouched


def test_aborted_wrong_state_and_the_interrupt_capsule_round_trip(env):
    from capsule_ros.bt import INTERRUPT_KEY, DropCapsule, FailureKind, Interrupt, Reenter
    from capsule_ros.errors import ErrorCode
    from capsule_ros.msg import CapsuleEvent
    proc, client, driver = env
    driver.run(observations(2, 101))
    ClientNode.drain(driver.events)
    first = Interrupt("Interrupt", node_path=NODE)
    assert run(first, client)[0] == Status.SUCCESS, first.feedback_message
    boundary = bb(INTERRUPT_KEY)
    assert events_of(driver, CapsuleEvent.INTERRUPT)[-1].capsule_id == boundary
    try:
        again = Interrupt("InterruptAgain", node_path=NODE)
        assert run(again, client)[0] == Status.FAILURE
        assert again.outcome.failure == FailureKind.SERVICE_ABORTED
        assert again.outcome.error_code == ErrorCode.WRONG_STATE
        drop = DropCapsule(capsule_key=INTERRUPT_KEY, node_path=NODE)
        assert run(drop, client)[0] == Status.FAILURE
        assert drop.outcome.failure == FailureKind.SERVICE_ABORTED and drop.outcome.error_code == ErrorCode.WRONG_STATE
        assert bb(INTERRUPT_KEY) == boundary           # a failed call never overwrites a result key
    finally:
        resume = Reenter("Resume", capsule_key=INTERRUPT_KEY, node_path=NODE)
        assert run(resume, client)[0] == Status.SUCCESS, resume.feedback_message
    assert resume.outcome.response.capsule.id == boundary
    assert driver.latest_status().episode_state == 1   # RUNNING


@pytest.mark.parametrize("value, verb, kwargs, reason", [
    (None, "Reenter", {}, "missing blackboard key '/capsule/last_good'"),   # key never set
    ("../etc/passwd", "Reenter", {}, "malformed"),
    ("", "Reenter", {}, "is empty"),                                         # not silently the interrupt capsule
    (42, "Reset", {"capsule_key": bt.LAST_GOOD_KEY}, "must be a string"),
    (None, "Fork", {"source_id": "has space"}, "malformed"),
])
def test_invalid_request_fails_on_the_first_tick_without_calling(env, value, verb, kwargs, reason):
    proc, client, driver = env
    if value is not None:
        py_trees.blackboard.Blackboard.set(bt.LAST_GOOD_KEY, value)
    leaf = getattr(bt, verb)(node_path=NODE, **kwargs)
    status, ticks, seconds, _ = run(leaf, client)
    assert status == Status.FAILURE and ticks == 1     # nothing was sent
    assert leaf.outcome.failure == bt.FailureKind.INVALID_REQUEST and leaf.outcome.error_code is None
    assert reason in leaf.outcome.message and "INVALID_REQUEST" in leaf.feedback_message


# -- the example tree -----------------------------------------------------------------------------
class GraspStub(py_trees.behaviour.Behaviour):
    """A grasp that drives the node ``steps`` steps (one joint state per tick, the same
    observations every try), waits for their actions, then succeeds or fails as scripted."""

    def __init__(self, driver, outcomes, steps=4):
        super().__init__(name="GraspStub")
        self.driver, self.outcomes, self.steps = driver, list(outcomes), steps
        self.obs = observations(steps, 102)
        self.tries = []            # the actions of each try

    def initialise(self):
        ClientNode.drain(self.driver.actions)
        self.sent = 0
        self.tries.append([])

    def update(self):
        self.tries[-1].extend(ClientNode.drain(self.driver.actions))
        if self.sent < self.steps:
            self.driver.joints_pub.publish(self.driver.joint_msg(self.obs[self.sent]))
            self.sent += 1
            return Status.RUNNING
        if len(self.tries[-1]) < self.steps:
            return Status.RUNNING
        ok = self.outcomes[min(len(self.tries), len(self.outcomes)) - 1]
        return Status.SUCCESS if ok else Status.FAILURE


def test_example_tree_reenters_the_committed_capsule_between_tries(env):
    from capsule_ros.bt import LAST_GOOD_KEY
    from capsule_ros.bt.example import grasp_with_retries
    from capsule_ros.msg import CapsuleEvent
    proc, client, driver = env
    driver.run(observations(3, 103))
    ClientNode.drain(driver.events)
    grasp = GraspStub(driver, [False, False, True])
    root = grasp_with_retries(grasp, tries=3, node_path=NODE)
    status, ticks, seconds, longest = run(root, client)
    assert status == Status.SUCCESS
    assert len(grasp.tries) == 3
    committed = bb(LAST_GOOD_KEY)
    events = ClientNode.drain(driver.events)
    kinds = [(e.kind, e.capsule_id) for e in events if e.kind in (CapsuleEvent.COMMIT, CapsuleEvent.REENTER)]
    assert kinds == [(CapsuleEvent.COMMIT, committed)] + [(CapsuleEvent.REENTER, committed)] * 2
    assert all(e.rollback for e in events if e.kind == CapsuleEvent.REENTER)
    commit_step = next(e.step for e in events if e.kind == CapsuleEvent.COMMIT)
    for actions in grasp.tries:   # every try starts at the committed step, from the committed state
        assert [a.step for a in actions] == list(range(commit_step + 1, commit_step + 1 + grasp.steps))
    for actions in grasp.tries[1:]:
        assert all(a.lineage == committed for a in actions)
        assert [np.asarray(a.values).tobytes() for a in actions] == \
            [np.asarray(a.values).tobytes() for a in grasp.tries[0]]
    assert longest < 0.1


def test_example_tree_gives_up_after_n_tries(env):
    from capsule_ros.bt import LAST_GOOD_KEY
    from capsule_ros.bt.example import grasp_with_retries
    from capsule_ros.msg import CapsuleEvent
    proc, client, driver = env
    ClientNode.drain(driver.events)
    grasp = GraspStub(driver, [False], steps=2)
    root = grasp_with_retries(grasp, tries=3, node_path=NODE)
    status, *_ = run(root, client)
    assert status == Status.FAILURE
    assert len(grasp.tries) == 3
    retry = next(b for b in root.iterate() if b.name == "Retry")
    assert "final failure" in retry.feedback_message
    committed = bb(LAST_GOOD_KEY)
    reenters = [e for e in ClientNode.drain(driver.events) if e.kind == CapsuleEvent.REENTER]
    assert [e.capsule_id for e in reenters] == [committed] * 3     # the last failed try is rolled back too
    assert driver.latest_status().lineage == committed


def test_example_tree_stops_when_a_rollback_fails(env):
    from capsule_ros.bt import LAST_GOOD_KEY, FailureKind
    from capsule_ros.bt.example import ROLLBACK_OUTCOME_KEY, grasp_with_retries
    from capsule_ros.errors import ErrorCode
    proc, client, driver = env

    class LoseTheCapsule(GraspStub):
        """Fails, and points the last-good key at a capsule the node does not know, so that
        the rollback is refused. (Dropping the committed capsule is not enough: the node
        rebuilds a dropped capsule of its own episode from its input log.)"""

        def update(self):
            status = super().update()
            if status == Status.FAILURE:
                py_trees.blackboard.Blackboard.set(LAST_GOOD_KEY, "e999.s1.000000")
            return status

    grasp = LoseTheCapsule(driver, [False], steps=2)
    root = grasp_with_retries(grasp, tries=3, node_path=NODE)
    status, *_ = run(root, client)
    assert status == Status.FAILURE
    assert len(grasp.tries) == 1                      # no second grasp from an unknown state
    outcome = bb(ROLLBACK_OUTCOME_KEY)
    assert outcome.failure == FailureKind.SERVICE_ABORTED and outcome.error_code == ErrorCode.NOT_FOUND


def test_example_main_against_a_live_node(tmp_path):
    """``python -m capsule_ros.bt.example`` with its in-process arm: the random-weight
    policy cannot reach the goal in 5 steps, so it rolls back and gives up after 2 tries."""
    ns = "/bt_example"
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns, tag="example")
    try:
        out = subprocess.run([sys.executable, "-m", "capsule_ros.bt.example", "--node", f"{ns}/capsule_policy",
                              "--tries", "2", "--step-budget", "5", "--rate", "50", "--server-wait", "30",
                              "--timeout", "60"],
                             cwd=REPO, capture_output=True, text=True, timeout=90)
    finally:
        assert proc.stop() == 0, proc.log()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "GraspWithRetries: FAILURE after 2 grasp attempt(s)" in out.stdout, out.stdout
    assert "rolled back to" in out.stdout and "not at the goal after 5 steps" in out.stdout


def test_the_discovery_grace_covers_a_first_call_and_the_first_after_the_server_was_gone():
    """A client's answer timeout: at least the grace until the server has answered it,
    the caller's own after that, the grace again once the server was seen gone; a caller's
    timeout above the grace is kept as it is."""
    from capsule_ros.ros.discovery import DiscoveryGrace
    grace = DiscoveryGrace(5.0)
    assert grace.timeout_s(1.0) == 5.0 and grace.timeout_s(30.0) == 30.0
    grace.on_answer()
    assert grace.timeout_s(1.0) == 1.0 and grace.timeout_s(0.25) == 0.25
    grace.on_server_gone()
    assert grace.timeout_s(1.0) == 5.0
    assert "discovery grace" in DiscoveryGrace.note(5.0, 1.0) and DiscoveryGrace.note(1.0, 1.0) == ""
    with pytest.raises(ValueError, match="grace_s"):
        DiscoveryGrace(-1.0)


def test_a_trees_first_call_to_a_just_started_node_is_answered(tmp_path, rclpy_context):
    """A tree that starts with the node sends its first call the moment the service is
    discovered, with the leaf's default call timeout (1 s), and gets the answer, also on a
    busy machine. The node offers its services only once it can answer them, and answers
    in milliseconds; but it may discover the tree's process after the tree discovered it
    and only then take the request (measured here: 0.15-0.6 s late, over 1 s in one CI
    run), so the leaf's first call to a server waits the discovery grace
    (capsule_ros.ros.discovery). The tree's node is a DDS participant of its own, started
    with the node, as a tree launched with it is."""
    from capsule_ros.bt import DEFAULT_CALL_TIMEOUT_S, Commit
    ns = unique_ns("btfirst")
    context = rclpy_context.Context()
    rclpy_context.init(context=context)
    client = ClientNode(rclpy_context, f"bt_first_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy",
                        context=context)
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns, tag="first")
    try:
        leaf = Commit(node_path=f"{ns}/capsule_policy", label="first call", server_wait_s=120.0)
        assert leaf.call_timeout_s == DEFAULT_CALL_TIMEOUT_S and not leaf.discovery.answered
        status, *_ = run(leaf, client, timeout=150.0)
        assert status == Status.SUCCESS, f"{leaf.feedback_message}\n{proc.log()[-2000:]}"
        assert leaf.outcome.response.capsule.label == "first call"
        assert leaf.discovery.answered            # the next calls wait the call timeout only
    finally:
        client.close()
        context.try_shutdown()
        assert proc.stop() == 0, proc.log()


def test_a_running_trees_leaf_gets_the_first_answer_of_a_restarted_node_then_times_out_at_its_own_timeout(
        tmp_path, rclpy_context):
    """The tree's process outlives the node (the tests' long-lived participant, which had
    seen the first node): the node stops, the leaf finds no server, a new node starts in the
    same namespace, and the leaf's next call (default call timeout, 1 s) is answered: the
    first call after the server was gone waits the discovery grace again (a new node can
    learn of a participant that had seen the earlier one up to 2.2 s late: docs/benchmarks.md,
    "A restarted node and a long-lived client"). Once the new node has answered, a call to
    it while it is stopped (SIGSTOP) fails at the leaf's own 1 s, not at the grace."""
    from capsule_ros.bt import Commit, FailureKind
    from capsule_ros.ros.discovery import DISCOVERY_GRACE_S
    ns = unique_ns("btrestart")
    path = f"{ns}/capsule_policy"
    client = ClientNode(rclpy_context, f"bt_restart_client_{ns.strip('/')}", node_path=path)
    leaf = Commit(node_path=path, label="restart", server_wait_s=120.0)
    proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns, tag="before")
    try:
        status, *_ = run(leaf, client, timeout=150.0)
        assert status == Status.SUCCESS, leaf.feedback_message
        assert proc.stop() == 0, proc.log()
        wait_for(lambda: not leaf._client.service_is_ready(), timeout=30.0, what="the stopped node's service gone")
        proc = start_policy_node(tmp_path, {"policy": {"weights": ""}}, namespace=ns, tag="after")
        status, *_ = run(leaf, client, timeout=150.0)          # waits for the new server, then calls it
        assert status == Status.SUCCESS, f"{leaf.feedback_message}\n{proc.log()[-2000:]}"
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            status, *_ = run(leaf, client, timeout=DISCOVERY_GRACE_S + 30.0)
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        assert status == Status.FAILURE and leaf.outcome.failure == FailureKind.SERVICE_TIMEOUT
        assert "no response within 1000 ms" in leaf.feedback_message and "grace" not in leaf.feedback_message
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()


def feeding(driver, period=0.02):
    """Publish joint states every ``period`` in a thread (trigger mode: each one is a step)
    until the returned event is set."""
    import threading
    stop = threading.Event()

    def feed():
        for values in observations(10_000, 11):
            if stop.is_set():
                return
            driver.joints_pub.publish(driver.joint_msg(values))
            time.sleep(period)
    threading.Thread(target=feed, daemon=True).start()
    return stop


def test_run_policy_leaf_runs_a_budget_and_hands_its_capsule_to_reenter(env):
    proc, client, driver = env
    leaf = bt.RunPolicy(max_steps=5, reset=True, node_path=NODE, goal_timeout_s=5.0)   # a loaded CI machine
    stop = feeding(driver)
    try:
        status, *_ = run(leaf, client)
    finally:
        stop.set()
    assert status == Status.SUCCESS, (leaf.outcome, proc.log()[-2000:])
    assert leaf.outcome.result.steps == 5 and bb(bt.INTERRUPT_KEY) == leaf.outcome.result.capsule.id
    assert driver.latest_status().episode_state == 2                    # interrupted at the budget's end
    status, *_ = run(bt.Reenter(capsule_key=bt.INTERRUPT_KEY, node_path=NODE), client)   # resumes from it
    assert status == Status.SUCCESS and driver.latest_status().episode_state == 1


def feedback_steps() -> int:
    """Steps in the latest RunPolicy feedback on the blackboard (0 before the first)."""
    feedback = py_trees.blackboard.Blackboard.storage.get(bt.FEEDBACK_KEY)
    return 0 if feedback is None else feedback.steps


def test_halting_the_run_policy_leaf_cancels_its_run(env):
    from capsule_ros.msg import CapsuleEvent
    proc, client, driver = env
    leaf = bt.RunPolicy(node_path=NODE, goal_timeout_s=5.0)
    py_trees.trees.setup(leaf, node=client.node)
    ClientNode.drain(driver.events)
    stop = feeding(driver)
    try:
        deadline = time.monotonic() + 20
        while leaf._result_future is None or feedback_steps() < 3:               # accepted and stepping
            leaf.tick_once()
            assert leaf.status == Status.RUNNING and time.monotonic() < deadline, leaf.outcome
            time.sleep(0.02)
        leaf.stop(Status.INVALID)                                        # a parent halts the branch
        interrupts = events_of(driver, CapsuleEvent.INTERRUPT, timeout=10)
        assert interrupts[0].capsule_id
        wait_for(lambda: driver.latest_status().episode_state == 2, timeout=10, what="the interrupted episode")
    finally:
        stop.set()
    client.capsules.reenter()


def test_an_action_client_made_on_a_spinning_node_never_stops_its_executor(rclpy_context):
    """rclpy's ActionClient gives itself to the node before it makes the lock its entity
    count takes, so an executor spinning in another thread can ask in between and die (its
    node then answers nothing: a RunPolicy behaviour made while the tree's node spins).
    Asked exactly there, SpinSafeActionClient answers; rclpy's own client does not."""
    from rclpy.action import ActionClient

    from capsule_ros.action import RunPolicy
    from capsule_ros.ros.spinning import SpinSafeActionClient
    node = rclpy_context.create_node("action_client_race")
    handed = node.add_waitable

    def add_waitable_asked_at_once(waitable):
        waitable.get_num_entities()            # what a spinning executor may do at this moment
        handed(waitable)
    node.add_waitable = add_waitable_asked_at_once
    try:
        client = SpinSafeActionClient(node, RunPolicy, "/race/run_policy")
        assert client.get_num_entities() is not None
        with pytest.raises(AttributeError, match="_lock"):
            ActionClient(node, RunPolicy, "/race/run_policy_plain")
    finally:
        node.destroy_node()
