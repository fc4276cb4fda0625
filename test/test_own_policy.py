"""Your own policy, served by the installed policy_node through ROS 2:

- the example package's kind (``policy.kind: gru_chunk``, registered by entry point,
  installed by ./setup.sh): its settings are read-only ROS parameters with their
  descriptions and ranges; a commit and a re-entry give bit-identical actions, and the
  bag recorded through ``~/record`` verifies with ``replay_bag``;
- the same module exported by ``capsule-ros export`` (``policy.kind: exported``): the
  node's actions equal the eager module's bit for bit; rollback and replay work unchanged.

(An unknown kind failing start-up is one case of test_node_safety's start-up errors.)
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml
from fixtures.make_bags import K, N, observations, record_rollback
from harness import REPO, ClientNode, Driver, action_bytes, restore_node, start_policy_node, wait_for
from runtime_fixtures import GRU_FACTORY, GRU_PARAMS, eager_gru

from capsule_ros.bag.replay import replay_bag

pytestmark = pytest.mark.ros
OVERRIDES = {"control": {"deadline_ms": 5000.0,       # a slow shared CPU must not turn steps into safe actions
                         "status_rate_hz": 20.0},     # send_goal waits for the goal in ~/status
             "ports": {"joints": {"qos": "reliable", "depth": 500}, "goal": {"depth": 500}},
             "runtime": {"device": "cpu"}}


def serve(tmp, rclpy_context, namespace: str, params_file):
    proc = start_policy_node(tmp, OVERRIDES, namespace=namespace, params_file=params_file, tag=namespace.strip("/"))
    client = ClientNode(rclpy_context, f"{namespace.strip('/')}_client", node_path=f"{namespace}/capsule_policy")
    return proc, client, Driver(client, namespace)


def restored(served):
    """A module's node, restored to a fresh node's state for the next test (``restore_node``)."""
    restore_node(served[1], {})
    ClientNode.drain(served[2].actions)
    return served


@pytest.fixture(scope="module")
def gru_shared(tmp_path_factory, rclpy_context):
    tmp = tmp_path_factory.mktemp("gru")
    proc, client, driver = serve(tmp, rclpy_context, "/tgru", GRU_PARAMS)
    yield proc, client, driver, tmp
    client.close()
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def gru_node(gru_shared):
    return restored(gru_shared)


@pytest.fixture
def exported_node(exported_shared):
    return restored(exported_shared)


@pytest.fixture(scope="module")
def exported_shared(tmp_path_factory, rclpy_context):
    """The example module exported with the settings of its parameter file, served from a
    copy of that file with policy.kind: exported."""
    tmp = tmp_path_factory.mktemp("exported")
    program = tmp / "gru.pt2"
    sets = [arg for name, value in GRU_FACTORY.items() for arg in ("--set", f"{name}={value}")]
    export = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "export", "--module",
                             "capsule_gru_policy.export:module", *sets, "--out", str(program)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert export.returncode == 0 and "bit for bit" in export.stdout, export.stdout + export.stderr
    document = yaml.safe_load(GRU_PARAMS.read_text())
    node_params = next(iter(document.values()))["ros__parameters"]
    node_params["policy"] = {"kind": "exported", "weights": "", "exported": {"program": str(program)}}
    params_file = tmp / "exported.yaml"
    params_file.write_text(yaml.safe_dump(document))
    proc, client, driver = serve(tmp, rclpy_context, "/texp", params_file)
    yield proc, client, driver, tmp
    client.close()
    assert proc.stop() == 0, proc.log()


def rollback_replays(driver, tmp) -> None:
    """Record a reset, a commit, and a rollback to it through ~/record: the node repeats its
    actions, and the bag verifies from the start of the episode."""
    info = record_rollback(driver, tmp / "rollback", "mcap", reset_first=True)
    assert info["identical_live"], "the node did not repeat its actions after the rollback"
    verdict = replay_bag(info["bag"])
    assert verdict.exit_code() == 0 and verdict.identical and verdict.complete, (verdict.first_divergence,
                                                                                 verdict.notes)
    assert verdict.steps_compared == verdict.steps_matched == N + (N - K)
    assert verdict.events_replayed == {"RESET": 1, "COMMIT": 1, "REENTER": 1}
    assert verdict.steps_before_anchor == verdict.steps_skipped == 0


def test_gru_chunk_settings_are_read_only_ros_parameters(gru_node):
    from rcl_interfaces.msg import ParameterType
    from rcl_interfaces.srv import DescribeParameters, GetParameters
    proc, client, driver, _ = gru_node
    names = ["policy.kind", "policy.gru_chunk.hidden", "policy.gru_chunk.chunk_horizon"]
    answers = {}
    for srv_type, service, request in (
            (DescribeParameters, "describe_parameters", DescribeParameters.Request(names=names)),
            (GetParameters, "get_parameters", GetParameters.Request(names=names))):
        cli = client.node.create_client(srv_type, f"/tgru/capsule_policy/{service}")
        assert cli.wait_for_service(timeout_sec=10)
        future = cli.call_async(request)
        wait_for(future.done, timeout=5, what=service)
        answers[service] = future.result()
    kind, hidden, horizon = answers["get_parameters"].values
    assert kind.string_value == "gru_chunk" and hidden.integer_value == 64 and horizon.integer_value == 8
    described = {d.name: d for d in answers["describe_parameters"].descriptors}
    assert all(described[name].read_only for name in names)
    assert described["policy.gru_chunk.hidden"].type == ParameterType.PARAMETER_INTEGER
    assert described["policy.gru_chunk.hidden"].description == "GRU hidden size; read-only: set at start-up " \
                                                                "(parameter file, launch arguments, --ros-args -p)"
    assert (described["policy.gru_chunk.hidden"].integer_range[0].from_value,
            described["policy.gru_chunk.hidden"].integer_range[0].to_value) == (1, 4096)


def test_gru_chunk_through_policy_node_rolls_back_and_replays_from_its_bag(gru_node):
    proc, client, driver, tmp = gru_node
    rollback_replays(driver, tmp)
    assert proc.alive(), proc.log()


def test_exported_program_through_policy_node_equals_the_eager_module_bit_for_bit(exported_node):
    proc, client, driver, _ = exported_node
    driver.capsules.reset()                                       # a new episode from the initial state
    driver.send_goal(0.3, 0.4)
    joints = observations(3 * 8 + 5, 7)
    actions = driver.run(joints)
    rows = np.concatenate([joints.astype(np.float32), np.tile(np.float32([0.3, 0.4]), (len(joints), 1))], axis=1)
    assert [a.step for a in actions] == list(range(1, len(joints) + 1))
    assert action_bytes(actions) == [(a.tobytes(), c.reshape(-1).tobytes()) for a, c in eager_gru(rows)]


def test_exported_program_through_policy_node_rolls_back_and_replays_from_its_bag(exported_node):
    proc, client, driver, tmp = exported_node
    rollback_replays(driver, tmp)
    assert proc.alive(), proc.log()
