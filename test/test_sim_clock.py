"""policy_node on a simulated clock that jumps back, as ``ros2 bag play --clock --loop``
makes it at every new loop: a real node with ``use_sim_time``, a bag played with its
``/clock`` loop after loop (``harness.ClockedBagPlayer``), what the node takes, acts on,
counts and reports through each jump, and a recording made across the jumps that replays
bit-identically."""
from __future__ import annotations

import itertools

import pytest
from harness import ClientNode, ClockedBagPlayer, observations, start_policy_node, unique_ns, wait_for, write_sensor_bag

pytestmark = pytest.mark.ros

LOOPS = 3
START_NS = 100 * 10**9                 # the simulated clock of the bag: 100 s ...
PERIOD_NS = 20_000_000                 # ... joint states at 50 Hz ...
JOINT_STATES = 75                      # ... for 1.5 s
IN_FLIGHT = 5                          # messages a jump may overtake on their way (on their own topic)


def looping_bag(path):
    """A goal at the bag's start, then joint states at 50 Hz, stamped with the log time."""
    from geometry_msgs.msg import PointStamped
    from sensor_msgs.msg import JointState
    goal = PointStamped()
    goal.header.stamp.sec = START_NS // 10**9
    goal.point.x, goal.point.y = 0.3, 0.4
    messages = [("/arm/goal", "geometry_msgs/msg/PointStamped", goal, START_NS)]
    for i, values in enumerate(observations(JOINT_STATES, 7)):
        msg = JointState()
        time_ns = START_NS + (i + 1) * PERIOD_NS
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(time_ns, 10**9)
        msg.name = ["shoulder", "elbow"]
        msg.position, msg.velocity = [float(values[0]), float(values[1])], [float(values[2]), float(values[3])]
        messages.append(("/arm/joint_states", "sensor_msgs/msg/JointState", msg, time_ns))
    return write_sensor_bag(path, messages)


@pytest.fixture
def sim_node(tmp_path, rclpy_context):
    """``sim_node(**control)``: policy_node with use_sim_time and the control settings, a
    client subscribed to what it publishes, and a player of the looping bag."""
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from capsule_ros.msg import Action, RuntimeStatus
    made = []

    def make(control, ports=None):
        ns = unique_ns("simclock")
        params = {"use_sim_time": True, "policy": {"weights": ""}, "control": {"deadline_ms": 5000.0, **control},
                  "ports": {"joints": {"qos": "reliable", "depth": 100}, **(ports or {})},
                  "record": {"enabled": True, "directory": str(tmp_path / "bags")}}
        proc = start_policy_node(tmp_path, params, namespace=ns)
        client = ClientNode(rclpy_context, f"simclock_client_{ns.strip('/')}", node_path=f"{ns}/capsule_policy")
        made.append((proc, client))
        reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        node = type("SimNode", (), {})()
        node.proc, node.client, node.ns = proc, client, ns
        node.actions = client.subscribe(Action, f"{ns}/capsule_policy/action", reliable)
        node.status = client.subscribe(RuntimeStatus, f"{ns}/capsule_policy/status")
        node.diagnostics = client.subscribe(DiagnosticArray, "/diagnostics", 100)
        node.player = ClockedBagPlayer(client, looping_bag(tmp_path / f"loop{len(made)}"), topic_prefix=ns)
        node.player.wait_for_node(node.status)
        return node

    yield make
    for proc, client in made:
        client.close()
        assert proc.stop() == 0, proc.log()


def joints_after_play(node):
    """The node's ``joints`` port once it took (or dropped) every joint state played."""
    def all_taken():
        statuses = ClientNode.drain(node.status)
        port = next((p for s in statuses[-1:] for p in s.ports if p.name == "joints"), None)
        return port if port is not None and port.received + sum(_drops(port).values()) >= LOOPS * JOINT_STATES \
            else None
    return wait_for(all_taken, timeout=60, what="every played joint state to be taken or dropped")


def _drops(port) -> dict:
    return {"shape": port.dropped_shape, "type": port.dropped_type, "nonfinite": port.dropped_nonfinite,
            "out_of_order": port.dropped_out_of_order, "future": port.dropped_future}


def diagnostic_values(node) -> dict:
    """The values of the node's latest /diagnostics report."""
    def ours():
        reports = [s for a in ClientNode.drain(node.diagnostics) for s in a.status
                   if s.name.startswith(f"{node.ns}/capsule_policy")]
        return {kv.key: kv.value for kv in reports[-1].values} if reports else None
    return wait_for(ours, timeout=30, what="a /diagnostics report of the node")


def test_trigger_mode_acts_through_every_backward_jump_and_the_recording_verifies(sim_node):
    from capsule_ros.bag.replay import replay_bag
    node = sim_node({"mode": "trigger", "trigger_port": "joints"})
    node.player.play(LOOPS)
    joints = joints_after_play(node)
    drops = _drops(joints)
    # only messages in flight at a jump may go: one of the new loop's that came before it (out of
    # order), or one of the old loop's queued behind it (now ahead of the clock)
    assert drops["out_of_order"] + drops["future"] <= IN_FLIGHT * (LOOPS - 1), drops

    stamps = [_ns(a.header.stamp) for a in ClientNode.drain(node.actions)]
    loops = [[stamps[0]]]                                # the actions, split where their stamps go back
    for previous, stamp in itertools.pairwise(stamps):
        if stamp < previous:
            loops.append([])
        loops[-1].append(stamp)
    assert len(loops) == LOOPS, [(loop[0], loop[-1], len(loop)) for loop in loops]
    for loop in loops:                                   # acting again right after each jump
        assert loop[0] <= START_NS + (1 + IN_FLIGHT) * PERIOD_NS and len(loop) >= JOINT_STATES - IN_FLIGHT

    values = diagnostic_values(node)
    assert values["clock_jumps"] == str(LOOPS - 1), values

    bag = node.client.capsules.record(False).bag_path
    verdict = replay_bag(bag)
    assert verdict.identical, (verdict.first_divergence, verdict.notes)
    assert verdict.events_replayed.get("CLOCK_JUMP") == LOOPS - 1, verdict.events_replayed
    assert verdict.steps_compared >= LOOPS * (JOINT_STATES - IN_FLIGHT)


def test_timer_mode_takes_new_inputs_after_a_jump_and_counts_a_withheld_port_stale(sim_node):
    """The goal comes in the first loop only; its staleness bound (2 s) is longer than a
    loop (1.5 s), so it goes stale in the second loop, on the timeline the clock jumped to."""
    node = sim_node({"mode": "timer", "rate_hz": 20.0}, ports={"goal": {"staleness_ms": 2000.0}})
    node.player.play(LOOPS, topics_after_first_loop=["/arm/joint_states"])
    joints = joints_after_play(node)
    assert joints.dropped_out_of_order + joints.dropped_future <= IN_FLIGHT * (LOOPS - 1), _drops(joints)
    status = node.status.get(timeout=10)
    goal = next(p for p in status.ports if p.name == "goal")
    assert goal.received == 1 and goal.stale_steps >= 20, goal     # ~1 s of loop 2 and all of loop 3 at 20 Hz
    assert status.clock_jumps == LOOPS - 1 and status.last_clock_jump_s == pytest.approx(
        -(JOINT_STATES * PERIOD_NS) / 1e9, abs=0.05)


def _ns(stamp) -> int:
    return int(stamp.sec) * 10**9 + int(stamp.nanosec)
