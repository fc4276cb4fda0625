"""``policy.kind: onnx`` without ROS: ONNX models run by ONNX Runtime over the arena.

- the fixtures (an rsl_rl recurrent actor exported as Isaac Lab's exporter does, the same
  exported by torch 2.13's default exporter with an external data file, an sb3-contrib
  RecurrentPPO actor with its episode-start flag) serve exactly what a plain
  ``InferenceSession.run`` loop answers, feeding h, c and the last action back; their
  committed traces agree;
- state pairs, the episode-start flag and the in-place decision come out as documented;
  an LSTM's state is moved back with one copy of one byte range; ONNX Runtime writes
  every output into its arena buffer; the observation terms give the same bits over
  numpy (a CPU arena) and torch (a CUDA one), projected gravity the plain formula's;
- capsules roll back, fork and reset bit-identically; restoring h but not c, or h and c
  but not the last action, diverges;
- the fingerprint follows the model's bytes (external data included), ONNX Runtime's
  version, the execution provider and the optimisation level;
- control flow and dynamic dimensions, bad terms and bad roles are refused or served as
  documented, each with a message naming what to change;
- Twist and TwistStamped ports; the ros2_control configuration of docs/onnx.md matches
  its parameter file;
- ``capsule-ros bench step --policy onnx`` reports the median of its rounds, identical
  actions and the machine's load;
- on a GPU with onnxruntime-gpu, the CUDA provider path (its graph, issue 32243's guard).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from onnx_models import recurrent_cell, with_if

from capsule_ros.benchmarks.onnx_step import ROUNDS, PlainLoop, sensor_rows
from capsule_ros.config import load_params_file
from capsule_ros.errors import ConfigError
from capsule_ros.policies.ort.model import read_model
from capsule_ros.policies.ort.policy import OnnxPolicy, cuda_graph_choice
from capsule_ros.runtime.engine import PolicyRuntime
from capsule_ros.serving.config import PortConfig, ServingConfig
from capsule_ros.serving.factory import build_policy, build_runtime, build_session
from capsule_ros.serving.ports import PortAdapter

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "test" / "fixtures" / "onnx"
SB3 = {"state": (("lstm_h", "lstm_h_out"), ("lstm_c", "lstm_c_out")), "episode_start": "episode_starts"}
PLAIN = {"rsl_rl_lstm": {}, "rsl_rl_lstm_dynamo": {}, "sb3_lstm": SB3}


def quadruped_params(tmp_path: Path, model: Path, **onnx) -> dict:
    """config/onnx_quadruped.yaml serving ``model`` on the CPU, with a private capsule directory."""
    params = load_params_file(REPO / "config" / "onnx_quadruped.yaml")
    params["policy"]["onnx"].update(model=str(model), **onnx)
    params["capsules"]["directory"] = str(tmp_path / "capsules")
    params["control"]["deadline_ms"] = 0.0
    return params


def quadruped(tmp_path: Path, model: Path, **onnx) -> ServingConfig:
    return ServingConfig.from_params(quadruped_params(tmp_path, model, **onnx))


def trace_rows(name: str) -> Tuple[List[Dict[str, np.ndarray]], dict, dict]:
    """The fixture's sensor values as the ports' buffers hold them, one dict per episode."""
    meta = json.loads((FIXTURES / name / "meta.json").read_text())
    trace = dict(np.load(FIXTURES / name / "trace.npz", allow_pickle=False))
    order = [meta["robot_joints"].index(n) for n in meta["policy_joints"]]
    episodes = [{"joints": np.concatenate([trace["joint_position"][e][:, order], trace["joint_velocity"][e][:, order]],
                                          axis=1),
                 "imu": np.concatenate([trace["imu_orientation"][e], trace["imu_angular_velocity"][e]], axis=1),
                 "cmd_vel": trace["command"][e], "base_twist": trace["base_linear_velocity"][e]}
                for e in range(meta["episodes"])]
    return episodes, trace, meta


def serve(runtime: PolicyRuntime, rows: Dict[str, np.ndarray], steps: int) -> Tuple[np.ndarray, np.ndarray]:
    """(joint targets, raw actions) of ``steps`` steps, one row of every port each."""
    targets, raw = [], []
    for t in range(steps):
        for name, view in runtime.staging.items():
            view[...] = rows[name][t]
        runtime.load_inputs()
        runtime.step()
        targets.append(runtime.read_outputs().action)
        raw.append(runtime.arena[f"onnx.{runtime.policy.roles.action.name}"].numpy().reshape(-1).copy())
    return np.stack(targets), np.stack(raw)


def plain(model: Path, config: ServingConfig, rows, steps: int, **loop) -> Tuple[np.ndarray, np.ndarray]:
    """The same steps through a plain InferenceSession.run loop."""
    reference = PlainLoop(model, config.policy_settings, **loop)
    targets = np.stack([reference.step(rows, t) for t in range(steps)])
    return targets, reference


def feed(session, rows: Dict[str, np.ndarray], steps: range) -> List[bytes]:
    out = []
    for t in steps:
        for name in ("imu", "cmd_vel", "base_twist", "joints"):
            session.loop.write_input(name, rows[name][t])
        out.append(session.loop.tick().values.tobytes())
    return out


# -- the fixtures against ONNX Runtime's own loop ------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PLAIN))
def test_fixtures_serve_a_plain_onnxruntime_loop_bit_for_bit(tmp_path, name):
    episodes, trace, meta = trace_rows(name)
    model = FIXTURES / name / "policy.onnx"
    config = quadruped(tmp_path, model)
    runtime = build_runtime(config)
    for e, rows in enumerate(episodes):
        runtime.reset(episode=e + 1)
        targets, raw = serve(runtime, rows, meta["steps"])
        reference = PlainLoop(model, config.policy_settings, **PLAIN[name])
        expected = np.stack([reference.step(rows, t) for t in range(meta["steps"])])
        assert targets.tobytes() == expected.astype(np.float32).tobytes(), name
        # the committed trace (recorded by the generator's ONNX Runtime loop on this machine kind)
        np.testing.assert_allclose(raw, trace["actions"][e], rtol=0, atol=1e-6)
        assert np.abs(trace["actions"][e] - trace["torch_actions"][e]).max() < 1e-5      # the export is faithful
        assert len({r.tobytes() for r in raw}) == meta["steps"] and raw.std() > 0.01     # nothing constant


def test_roles_pairs_and_one_copy_of_one_range(tmp_path):
    runtime = build_runtime(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx"))
    policy = runtime.policy
    assert isinstance(policy, OnnxPolicy)
    roles = policy.roles.describe()
    assert roles["observation"] == "obs float32[1, 48]" and roles["action"] == "actions float32[1, 12]"
    assert [(p["input"].split()[0], p["output"].split()[0], p["binding"]) for p in roles["state"]] == \
        [("h_in", "h_out", "copy"), ("c_in", "c_out", "copy")]      # the LSTM reads h_in and writes h_out
    kinds = {s["name"]: s["kind"] for s in runtime.layout.schema()}
    assert {k: kinds[k] for k in ("onnx.h_in", "onnx.c_in", "onnx.h_out", "onnx.c_out", "onnx.actions",
                                  "onnx.obs")} == {"onnx.h_in": "recurrent", "onnx.c_in": "recurrent",
                                                   "onnx.h_out": "recurrent", "onnx.c_out": "recurrent",
                                                   "onnx.actions": "recurrent", "onnx.obs": "output"}
    binding = next(iter(policy._bindings.values()))
    assert len(binding.copies) == 1                                   # h and c back with one copy
    target, source = binding.copies[0]
    assert target.size == source.size == runtime.layout["onnx.c_in"].end - runtime.layout["onnx.h_in"].offset
    sb3 = build_runtime(quadruped(tmp_path / "sb3", FIXTURES / "sb3_lstm" / "policy.onnx")).policy.roles
    assert sb3.episode_start is not None and sb3.episode_start.name == "episode_starts"
    assert [(p.input.name, p.output.name) for p in sb3.pairs] == [("lstm_h", "lstm_h_out"), ("lstm_c", "lstm_c_out")]


def test_a_state_output_the_graph_allows_is_written_in_place(tmp_path):
    model = recurrent_cell(tmp_path / "cell.onnx")
    rows = sensor_rows(30, seed=3)
    results = {}
    for binding in ("auto", "copy"):
        config = quadruped(tmp_path / binding, model, state_binding=binding)
        runtime = build_runtime(config)
        names = runtime.layout.names()
        assert ("onnx.h_out" in names) == (binding == "copy")
        assert runtime.policy.roles.pairs[0].in_place == (binding == "auto")
        targets, _ = serve(runtime, rows, 30)
        expected, _ = plain(model, config, rows, 30, state=(("h_in", "h_out"),))
        assert targets.tobytes() == expected.tobytes(), binding
        results[binding] = targets.tobytes()
    assert results["auto"] == results["copy"]


@pytest.mark.parametrize("name, outputs", [
    ("rsl_rl_lstm", {"actions": "onnx.actions", "h_out": "onnx.h_out", "c_out": "onnx.c_out"}),
    ("cell", {"actions": "onnx.actions", "h_out": "onnx.h_in"}),          # written in place
])
def test_onnx_runtime_writes_every_output_into_its_arena_buffer(tmp_path, name, outputs):
    """No allocation per step: after steps have run, each output ONNX Runtime's IO binding
    holds lies at the address of its arena buffer (ONNX Runtime allocated none of its own)."""
    model = recurrent_cell(tmp_path / "cell.onnx") if name == "cell" else FIXTURES / name / "policy.onnx"
    runtime = build_runtime(quadruped(tmp_path, model))
    serve(runtime, sensor_rows(5, seed=2), 5)
    binding = next(iter(runtime.policy._bindings.values()))
    bound = binding.io.get_outputs()
    assert len(bound) == len(outputs)
    assert sorted(value.data_ptr() for value in bound) == sorted(runtime.arena[buffer].data_ptr()
                                                                 for buffer in outputs.values())
    assert sorted(tuple(value.shape()) for value in bound) == sorted(tuple(runtime.arena[buffer].shape)
                                                                      for buffer in outputs.values())


def test_the_observation_terms_give_the_same_bits_over_numpy_and_over_torch(tmp_path):
    """A CPU arena's step assembles the observation with numpy, a CUDA arena's with torch
    (``capsule_ros.policies.ort.arrays``): the same operations in the same order, so the
    same bits; here both run over the same CPU arena, with values that the clips cut."""
    from capsule_ros.policies.ort.arrays import NUMPY, TORCH
    from capsule_ros.policies.ort.observations import assembler, constant_tensors
    runtime = build_runtime(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx"))
    plan, state = runtime.policy.observations, runtime.arena.views
    last = state["onnx.actions"].reshape(-1)
    rng = np.random.default_rng(4)
    with torch.inference_mode():
        outs = {ops: torch.empty(plan.size) for ops in (NUMPY, TORCH)}
        assemble = {ops: assembler(plan, state, out, last, constant_tensors(plan), ops) for ops, out in outs.items()}
        rows = sensor_rows(20, seed=5)
        rows["base_twist"] *= 8.0
        for t in range(20):
            for name, values in rows.items():
                state[name].copy_(torch.from_numpy(values[t]))
            last.copy_(torch.from_numpy(rng.normal(0, 8, last.numel()).astype(np.float32)))
            for fn in assemble.values():
                fn()
            assert outs[NUMPY].numpy().tobytes() == outs[TORCH].numpy().tobytes(), t
        assert outs[NUMPY].abs().max() == 10.0                           # the last action's clip cut


@pytest.mark.parametrize("term, offset, scale", [("projected_gravity:imu.orientation", 0.0, 1.0),
                                                  ("projected_gravity:imu.orientation offset=0.25 scale=3", 0.25, 3.0)])
def test_projected_gravity_is_the_plain_formula_to_the_bit(tmp_path, term, offset, scale):
    """(2(wy - xz), -2(wx + yz), 2(x^2 + y^2) - 1) as a plain numpy loop computes it, then
    the term's offset and scale, over numpy and over torch; without an offset of its own
    the z's ``- 1`` is done by the offset vector, with one it is a step of its own."""
    from capsule_ros.policies.ort.arrays import NUMPY, TORCH
    from capsule_ros.policies.ort.observations import ObservationPlan, assembler, constant_tensors
    config = quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx")
    plan = ObservationPlan.parse([term], config.ports, (), 12, "test")
    imu = torch.zeros(7)
    with torch.inference_mode():
        outs = {ops: torch.empty(3) for ops in (NUMPY, TORCH)}
        assemble = [assembler(plan, {"imu": imu}, out, torch.zeros(12), constant_tensors(plan), ops)
                    for ops, out in outs.items()]
        for x, y, z, w, *_ in sensor_rows(50, seed=9)["imu"]:
            imu[:4] = torch.tensor([x, y, z, w])
            two = np.float32(2.0)
            gravity = np.array([two * (w * y - x * z), -two * (w * x + y * z), two * (x * x + y * y) - np.float32(1)],
                               np.float32)
            expected = ((gravity - np.float32(offset)) * np.float32(scale)).astype(np.float32).tobytes()
            for fn in assemble:
                fn()
            assert [out.numpy().tobytes() for out in outs.values()] == [expected, expected]


def test_the_benchmark_reports_rounds_identical_actions_and_the_load():
    """``capsule-ros bench step --policy onnx --quick --json``: the ratio of each variant is
    the median of its rounds' ratios, with their range, the served actions equal the plain
    loop's bit for bit, and the machine's load is recorded. Timings are printed, never
    asserted (docs/benchmarks.md holds the figures)."""
    done = subprocess.run([sys.executable, "-m", "capsule_ros.cli.main", "bench", "step", "--policy", "onnx",
                           "--device", "cpu", "--quick", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for variant in ("guarded", "unguarded"):
        row = result[variant]
        assert row["identical_actions"] is True
        assert len(row["round_ratios"]) == ROUNDS == result["rounds"]
        assert row["ratio"] == float(np.median(row["round_ratios"]))
        assert row["spread"] == [min(row["round_ratios"]), max(row["round_ratios"])]
    assert result["ratio"] == result["guarded"]["ratio"] and result["met"] == (result["ratio"] <= 1.1)
    assert len(result["load_average"]) == len(result["load_average_after"]) == 3
    print(f"served / plain (quick model) {result['ratio']:.3f}, rounds {result['guarded']['round_ratios']}")


def test_the_ros2_control_configuration_matches_the_parameter_file():
    """config/quadruped_controllers.yaml (the ros2_control configuration of docs/onnx.md)
    against config/onnx_quadruped.yaml: the controller types; the joint state broadcaster
    publishes /joint_states with every joint of the joints port and the interfaces its
    fields read, and runs at the rate the policy steps at; the IMU broadcaster publishes
    ``/<name>/imu`` in the control frame; the forward command controller takes the legs
    output (Float64MultiArray on ``/<name>/commands``, its interface) with ``indices``
    mapping each of its joints to the policy's joint of that name."""
    import yaml
    controllers = yaml.safe_load((REPO / "config" / "quadruped_controllers.yaml").read_text())
    node = load_params_file(REPO / "config" / "onnx_quadruped.yaml")
    manager = controllers["controller_manager"]["ros__parameters"]
    kinds = {"joint_state_broadcaster/JointStateBroadcaster": "joints",
             "imu_sensor_broadcaster/IMUSensorBroadcaster": "imu",
             "forward_command_controller/ForwardCommandController": "legs"}
    name = {kinds[entry["type"]]: controller for controller, entry in manager.items() if isinstance(entry, dict)}
    assert sorted(name) == sorted(kinds.values())
    joints, imu, legs = (controllers[name[kind]]["ros__parameters"] for kind in ("joints", "imu", "legs"))
    ports, output, control = node["ports"], node["outputs"]["legs"], node["control"]

    assert (ports["joints"]["topic"], ports["joints"]["type"]) == ("/joint_states", "sensor_msgs/msg/JointState")
    assert sorted(joints["joints"]) == sorted(ports["joints"]["names"]) and len(set(joints["joints"])) == 12
    assert set(ports["joints"]["fields"]) <= set(joints["interfaces"])
    assert control["mode"] == "trigger" and control["trigger_port"] == "joints"
    assert joints["update_rate"] == 50 and manager["update_rate"] % joints["update_rate"] == 0

    assert ports["imu"]["topic"] == f"/{name['imu']}/imu"
    assert ports["imu"]["type"] == "sensor_msgs/msg/Imu" and imu["frame_id"] == control["frame_id"]

    assert output["topic"] == f"/{name['legs']}/commands"
    assert output["type"] == "std_msgs/msg/Float64MultiArray" and output["interface"] == legs["interface_name"]
    assert [ports["joints"]["names"][i] for i in output["indices"]] == legs["joints"] == joints["joints"]


# -- capsules -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows() -> Dict[str, np.ndarray]:
    return sensor_rows(60, seed=11)


def test_rollback_fork_and_reset_are_bit_identical(tmp_path, rows):
    session = build_session(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx"))
    start = feed(session, rows, range(20))
    capsule = session.verbs.commit(label="k")
    first = feed(session, rows, range(20, 45))
    fork = session.verbs.fork(capsule.id, label="branch")
    session.verbs.reenter(capsule.id)
    assert feed(session, rows, range(20, 45)) == first                  # rollback
    session.verbs.reenter(fork.id)
    assert feed(session, rows, range(20, 45)) == first                  # the fork holds the same state
    session.verbs.reset()
    assert feed(session, rows, range(20)) == start                   # a reset is the initial state
    assert len(set(first)) == len(first)


@pytest.mark.parametrize("kept", [("onnx.c_in", "onnx.actions"), ("onnx.actions",)],
                         ids=["h-only", "h-and-c-not-last-action"])
def test_restoring_h_without_c_or_the_last_action_diverges(tmp_path, rows, kept):
    """The ablation: re-enter a capsule but keep the live values of some buffers (they
    are not restored); the actions that follow differ from the timeline's."""
    session = build_session(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx"))
    feed(session, rows, range(20))
    capsule = session.verbs.commit(label="k")
    first = feed(session, rows, range(20, 40))
    arena = session.parts.runtime.arena
    live = {name: arena[name].clone() for name in kept}
    session.verbs.reenter(capsule.id)
    assert not all(torch.equal(arena[n], live[n]) for n in kept)        # the capsule's values differ
    for name, value in live.items():
        arena[name].copy_(value)                                         # ... and are not restored
    ablated = feed(session, rows, range(20, 40))
    assert ablated[0] != first[0] and sum(a != b for a, b in zip(ablated, first, strict=True)) >= 10
    session.verbs.reenter(capsule.id)
    assert feed(session, rows, range(20, 40)) == first                  # restoring everything is exact


# -- identity -----------------------------------------------------------------------------------------

def test_the_fingerprint_covers_model_bytes_onnxruntime_provider_and_level(tmp_path):
    import onnxruntime
    fixture = FIXTURES / "rsl_rl_lstm_dynamo"
    copy = tmp_path / "copy"
    shutil.copytree(fixture, copy)
    base = build_runtime(quadruped(tmp_path / "a", fixture / "policy.onnx"))
    architecture = base.policy.architecture()
    assert architecture["onnxruntime"] == onnxruntime.__version__
    assert architecture["execution_provider"] == "CPUExecutionProvider" and architecture["optimization"] == "all"
    assert read_model(fixture / "policy.onnx", {}, "m").files == ("policy.onnx", "policy.onnx.data")
    assert build_runtime(quadruped(tmp_path / "b", copy / "policy.onnx")).fingerprint == base.fingerprint  # moved
    other_level = build_runtime(quadruped(tmp_path / "c", fixture / "policy.onnx", optimization="basic"))
    assert other_level.fingerprint != base.fingerprint
    data = bytearray((copy / "policy.onnx.data").read_bytes())
    data[-1] ^= 1                                                        # one bit of one weight
    (copy / "policy.onnx.data").write_bytes(bytes(data))
    assert build_runtime(quadruped(tmp_path / "d", copy / "policy.onnx")).fingerprint != base.fingerprint


# -- what is served eagerly, and what is refused --------------------------------------------------------

def test_control_flow_is_served_on_the_cpu_and_kept_from_a_cuda_graph(tmp_path):
    model = with_if(tmp_path / "if.onnx")
    info = read_model(model, {}, "policy.onnx.model")
    assert info.control_flow and info.control_flow[0].startswith("If node")
    assert cuda_graph_choice(info, "auto") == (False, f"the model has control flow ({info.control_flow[0]})")
    with pytest.raises(ConfigError, match=r"cuda_graph is 'on' but the model has control flow \(If node"):
        cuda_graph_choice(info, "on")
    assert cuda_graph_choice(read_model(FIXTURES / "rsl_rl_lstm" / "policy.onnx", {}, "m"), "auto") == (True, "")
    config = quadruped(tmp_path, model)
    rows = sensor_rows(20, seed=5)
    targets, _ = serve(build_runtime(config), rows, 20)
    expected, _ = plain(model, config, rows, 20, state=(("h_in", "h_out"),))
    assert targets.tobytes() == expected.tobytes()
    assert not build_runtime(config).policy.roles.pairs[0].in_place      # control flow: always copied


def test_a_dynamic_dimension_is_refused_until_it_is_given_a_size(tmp_path):
    model = recurrent_cell(tmp_path / "dynamic.onnx", batch="batch")
    with pytest.raises(ConfigError, match=r"input 'obs' has the dynamic dimension 'batch' \(axis 0\).*"
                                          r"policy.onnx.dims: \['batch=N'\]"):
        build_runtime(quadruped(tmp_path, model))
    config = quadruped(tmp_path, model, dims=["batch=1"])
    rows = sensor_rows(10, seed=6)
    targets, _ = serve(build_runtime(config), rows, 10)
    assert targets.tobytes() == plain(model, config, rows, 10, state=(("h_in", "h_out"),))[0].tobytes()


@pytest.mark.parametrize("change, expect", [
    ({"observations": ["velocity:imu"]}, r"unknown function 'velocity'; known: \["),
    ({"observations": ["base_ang_vel:gyro"]}, r"no port 'gyro' \(ports.names: \['joints', 'imu', 'cmd_vel'"),
    ({"observations": ["base_ang_vel:imu.linear_acceleration"]},
     r"'linear_acceleration' is not one of ports.imu.fields \['orientation', 'angular_velocity'\]"),
    ({"observations": ["projected_gravity:imu.angular_velocity"]}, r"orientation quaternion .* 4 values, not 3"),
    ({"observations": ["base_ang_vel:imu.angular_velocity scale=1,2"]}, r"2 values for a term of 3"),
    ({"observations": ["last_action clip=3,1"]}, r"clip=3.0,1.0 must be LO,HI"),
    ({"observations": ["joint_pos_rel:joints.position", "last_action"], "default_joint_pos": [0.0]},
     r"joint_pos_rel needs policy.onnx.default_joint_pos with 12 values"),
    ({"observations": ["joint_pos_rel:joints.position", "last_action"]},
     r"the observation terms make 24 values \(joint_pos_rel:joints.position 12, last_action 12\), the model's "
     r"observation input obs float32\[1, 48\] takes 48"),
    ({"state": ["h_in:h_next"]}, r"pairs 'h_in' with 'h_next', but the model has no output 'h_next'"),
    ({"state": ["h_in:h_out"]}, r"the model's inputs \['c_in'\] are neither the observation"),
    ({"action_scale": [1.0, 2.0]}, r"action_scale: 2 values for 12 actions"),
    ({"execution_provider": "cuda"}, r"execution_provider is 'cuda' but this onnxruntime .* has only"),
])
def test_bad_settings_are_refused_naming_what_to_change(tmp_path, change, expect):
    with pytest.raises(ConfigError, match=expect):
        build_policy(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx", **change))


def test_an_input_nothing_feeds_weights_and_a_cuda_runtime_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"the model's inputs \['goal'\] are neither the observation"):
        build_policy(quadruped(tmp_path, recurrent_cell(tmp_path / "goal.onnx", extra_input=True)))
    params = quadruped_params(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx")
    params["policy"]["weights"] = "builtin:arm_reach"
    with pytest.raises(ConfigError, match=r"an ONNX model carries its own weights; set policy.weights: ''"):
        build_policy(ServingConfig.from_params(params))
    policy = build_policy(quadruped(tmp_path, FIXTURES / "rsl_rl_lstm" / "policy.onnx"))
    with pytest.raises(ConfigError, match=r"execution_provider is 'cpu' but the runtime is on cuda: set "
                                          r"runtime.device: cpu \(or execution_provider: cuda"):
        policy.to("cuda")


# -- the new port types --------------------------------------------------------------------------------

def test_twist_and_twist_stamped_ports():
    from rosbags.typesys import Stores, get_typestore
    store = get_typestore(Stores.ROS2_KILTED)
    Twist, Vector3 = store.types["geometry_msgs/msg/Twist"], store.types["geometry_msgs/msg/Vector3"]
    TwistStamped, Header = store.types["geometry_msgs/msg/TwistStamped"], store.types["std_msgs/msg/Header"]
    Time = store.types["builtin_interfaces/msg/Time"]
    twist = Twist(linear=Vector3(x=0.5, y=-0.25, z=0.0), angular=Vector3(x=0.0, y=0.0, z=1.5))
    command = PortAdapter("cmd_vel", PortConfig.from_mapping({"topic": "cmd_vel", "type": "geometry_msgs/Twist",
                                                              "fields": ["linear.x", "linear.y", "angular.z"],
                                                              "shape": [3]}, section="ports.cmd_vel"))
    assert command.accept(twist).tolist() == [0.5, -0.25, 1.5]
    stamped = TwistStamped(header=Header(stamp=Time(sec=3, nanosec=0), frame_id="base"), twist=twist)
    base = PortAdapter("base", PortConfig.from_mapping({"topic": "t", "type": "geometry_msgs/msg/TwistStamped",
                                                        "fields": ["twist.linear", "twist.angular"], "shape": [6]},
                                                       section="ports.base"))
    assert base.accept(stamped).tolist() == [0.5, -0.25, 0.0, 0.0, 0.0, 1.5]
    older = TwistStamped(header=Header(stamp=Time(sec=2, nanosec=0), frame_id="base"), twist=twist)
    with pytest.raises(Exception, match="older than the last accepted"):
        base.accept(older)


# -- CUDA (onnxruntime-gpu) -----------------------------------------------------------------------------

def _cuda_provider() -> bool:
    import onnxruntime
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_provider(), reason="needs onnxruntime-gpu (this environment has the CPU build); "
                                                 "the CPU provider path is tested above, the CUDA one on a GPU machine")
def test_cuda_provider_graph_equals_eager_and_capsules_roll_back(tmp_path, rows):
    model = FIXTURES / "rsl_rl_lstm" / "policy.onnx"
    results = {}
    for mode in ("on", "off"):
        params = quadruped_params(tmp_path / mode, model, execution_provider="cuda", cuda_graph=mode)
        params["runtime"]["device"] = "cuda"
        session = build_session(ServingConfig.from_params(params))
        assert int(session.parts.runtime.arena["step"][0]) == 0                   # capture runs left no trace (32243)
        assert torch.count_nonzero(session.parts.runtime.arena["onnx.h_in"]) == 0
        feed(session, rows, range(10))
        capsule = session.verbs.commit(label="k")
        first = feed(session, rows, range(10, 30))
        session.verbs.reenter(capsule.id)
        assert feed(session, rows, range(10, 30)) == first
        results[mode] = first
    assert results["on"] == results["off"]
