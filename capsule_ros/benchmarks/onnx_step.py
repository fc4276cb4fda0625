"""`capsule-ros bench step --policy onnx`: an Isaac Lab-style recurrent ``policy.onnx``
served through ``policy.kind: onnx`` against a plain ONNX Runtime loop on the same model,
side by side in one run, and the snapshot / restore of its state against the copy limit.

The model (``write_lstm_policy``): what Isaac Lab's exporter writes for an rsl_rl
recurrent actor (an empirical normaliser, one LSTM layer, an ELU MLP head; inputs ``obs,
h_in, c_in``, outputs ``actions, h_out, c_out``, opset 17), built with ``onnx.helper``
and seeded weights: LSTM 256 and MLP [512, 256, 128] on 48 observations and 12 joints
(the size of Isaac Lab's rough-terrain locomotion actors); ``--quick``: LSTM 64, MLP [64, 64].

- ``served``: what the node pays per step (``runtime.load_inputs``, ``step``,
  ``read_outputs``) with ``config/onnx_quadruped.yaml``'s observation terms and action map,
  with the step guard (as the node runs) and without it;
- ``plain``: an ``onnxruntime.InferenceSession.run`` loop on the same file with the same
  session options, doing the same work in numpy: the observation from the sensor values,
  the run with h, c and the last action fed back, the joint targets;
- ``ratio``: served p50 over plain p50 (target <= 1.1 on a CPU). The two are timed in
  alternating blocks so that a busy machine slows both alike, in ``ROUNDS`` rounds (each
  with both variants); the ratio is the median of the rounds' ratios, and ``spread`` their
  range. The load average before (``load_average``) and after the run is recorded.

On a GPU the CUDA provider needs onnxruntime-gpu, which the H200 machine does not have
(its wheel is too large to carry there): the benchmark says so instead of a figure.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

from capsule_ros.benchmarks.common import config_path, emit, environment, pct, print_table, resolve_device
from capsule_ros.config import load_params_file

OBS, ACTIONS = 48, 12
ROUNDS, BLOCKS = 5, 4         # alternating blocks per round; the ratio is the median of the rounds'


@dataclass(frozen=True)
class Shape:
    hidden: int
    mlp: Tuple[int, ...]


FULL = Shape(256, (512, 256, 128))
QUICK = Shape(64, (64, 64))


def write_lstm_policy(path: Path, hidden: int, mlp: Sequence[int], obs: int = OBS, actions: int = ACTIONS,
                      seed: int = 0) -> Path:
    """An Isaac Lab-style recurrent policy.onnx (module docstring) with seeded weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, scale: float = 1.0) -> onnx.TensorProto:
        fan_in = shape[-1] if len(shape) > 1 else 1
        return numpy_helper.from_array((rng.normal(size=shape) * scale / np.sqrt(fan_in)).astype(np.float32), name)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (1, obs)).astype(np.float32), "norm_mean"),
             numpy_helper.from_array(rng.uniform(0.5, 2.0, (1, obs)).astype(np.float32), "norm_std"),
             weight("W", 1, 4 * hidden, obs), weight("R", 1, 4 * hidden, hidden),
             numpy_helper.from_array(rng.normal(0, 0.1, (1, 8 * hidden)).astype(np.float32), "B"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.array([0, 1], np.int64), "axes01")]
    nodes = [helper.make_node("Sub", ["obs", "norm_mean"], ["centred"]),
             helper.make_node("Div", ["centred", "norm_std"], ["normalised"]),
             helper.make_node("Unsqueeze", ["normalised", "axis0"], ["sequence"]),
             helper.make_node("LSTM", ["sequence", "W", "R", "B", "", "h_in", "c_in"], ["Y", "h_out", "c_out"],
                              hidden_size=hidden),
             helper.make_node("Squeeze", ["Y", "axes01"], ["latent0"])]
    width = hidden
    for i, size in enumerate([*mlp, actions]):
        inits += [weight(f"fc{i}.weight", size, width), numpy_helper.from_array(np.zeros(size, np.float32),
                                                                                 f"fc{i}.bias")]
        last = i == len(mlp)
        nodes.append(helper.make_node("Gemm", [f"latent{i}", f"fc{i}.weight", f"fc{i}.bias"],
                                      ["actions" if last else f"pre{i}"], transB=1))
        if not last:
            nodes.append(helper.make_node("Elu", [f"pre{i}"], [f"latent{i + 1}"]))
        width = size
    state = [1, 1, hidden]
    graph = helper.make_graph(
        nodes, "isaaclab_recurrent_policy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, [1, obs]),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, state),
         helper.make_tensor_value_info("c_in", TensorProto.FLOAT, state)],
        [helper.make_tensor_value_info("actions", TensorProto.FLOAT, [1, actions]),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, state),
         helper.make_tensor_value_info("c_out", TensorProto.FLOAT, state)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="capsule_ros",
                              ir_version=8)               # what ONNX Runtime 1.16 and later read
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def quadruped_config(model: Path, **runtime):
    """config/onnx_quadruped.yaml serving ``model`` (capsules in memory only)."""
    from capsule_ros.serving.config import ServingConfig
    params = load_params_file(config_path("onnx_quadruped.yaml"))
    params["policy"]["onnx"]["model"] = str(model)
    params["capsules"]["directory"] = ""
    params["runtime"].update(runtime)
    return ServingConfig.from_params(params)


def sensor_rows(n: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Seeded port values: joints [n, 24], imu [n, 7] (unit quaternion, rates), cmd_vel,
    base_twist [n, 3]."""
    rng = np.random.default_rng(seed)
    quaternion = rng.normal(size=(n, 4))
    quaternion /= np.linalg.norm(quaternion, axis=1, keepdims=True)
    return {"joints": rng.normal(0, 0.5, (n, 24)).astype(np.float32),
            "imu": np.concatenate([quaternion, rng.normal(0, 0.5, (n, 3))], axis=1).astype(np.float32),
            "cmd_vel": rng.uniform(-1, 1, (n, 3)).astype(np.float32),
            "base_twist": rng.normal(0, 0.3, (n, 3)).astype(np.float32)}


class PlainLoop:
    """A plain ONNX Runtime loop on one model (module docstring): ``step(rows, t)`` returns
    the joint targets; the observation is the quadruped file's terms written in numpy.
    ``state``: the (input, output) names fed back; ``episode_start``: an input fed 1 on
    the first step after ``reset`` and 0 after ('' for none)."""

    def __init__(self, model: Path, settings, threads: int = 1,
                 state: Sequence[Tuple[str, str]] = (("h_in", "h_out"), ("c_in", "c_out")), episode_start: str = ""):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
        self.shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.pairs, self.episode_start = list(state), episode_start
        self.default = np.asarray(settings.default_joint_pos, np.float32)
        self.scale = np.float32(settings.action_scale[0])
        self.obs = np.empty(OBS, np.float32)
        self.reset()

    def reset(self) -> None:
        """A new episode: zero state, zero last action, the episode-start flag set."""
        self.state = {name: np.zeros([d if isinstance(d, int) else 1 for d in self.shapes[name]], np.float32)
                      for name, _ in self.pairs}
        self.last = np.zeros(ACTIONS, np.float32)
        self.first = True

    def observation(self, joints, imu, cmd, twist) -> np.ndarray:
        x, y, z, w = imu[0], imu[1], imu[2], imu[3]
        two = np.float32(2.0)
        gravity = np.array([two * (w * y - x * z), -two * (w * x + y * z), two * (x * x + y * y) - np.float32(1.0)],
                           np.float32)
        o = self.obs
        o[0:3] = np.clip(twist, np.float32(-5), np.float32(5)) * np.float32(2.0)
        o[3:6] = imu[4:7] * np.float32(0.25)
        o[6:9] = gravity
        o[9:12] = cmd * np.array([2.0, 2.0, 0.25], np.float32)
        o[12:24] = joints[:12] - self.default
        o[24:36] = joints[12:] * np.float32(0.05)
        o[36:48] = np.clip(self.last, np.float32(-10), np.float32(10))
        return o

    def step(self, rows: Dict[str, np.ndarray], t: int) -> np.ndarray:
        obs = self.observation(rows["joints"][t], rows["imu"][t], rows["cmd_vel"][t], rows["base_twist"][t])
        feeds = {"obs": obs[None], **self.state}
        if self.episode_start:
            feeds[self.episode_start] = np.array([1.0 if self.first else 0.0], np.float32)
        out = dict(zip(self.outputs, self.session.run(None, feeds), strict=True))
        self.state = {name: out[back] for name, back in self.pairs}
        self.first = False
        self.last = out["actions"][0]
        return self.last * self.scale + self.default


def served_and_plain(model: Path, rows: Dict[str, np.ndarray], reps: int,
                     guard: bool) -> Tuple[Callable[[], None], Callable[[], None], Callable[[], bool]]:
    """(served step, plain step, same) on ``model``, each step taking the next of ``rows``
    per call: the served one stages the ports, loads them, steps (with the step guard or
    without) and reads the outputs, as the node does. ``same()``: whether both have run as
    many steps and their last joint targets are the same bits."""
    from capsule_ros.runtime.builder import build_policy_runtime
    from capsule_ros.serving.factory import build_policy
    config = quadruped_config(model, device="cpu", guard_steps=guard)
    runtime = build_policy_runtime(build_policy(config), config.runtime)
    plain = PlainLoop(model, config.policy_settings)
    counter = {"served": 0, "plain": 0}
    last: Dict[str, np.ndarray] = {}

    def served_step() -> None:
        t = counter["served"] % reps
        counter["served"] += 1
        for name, view in runtime.staging.items():
            view[...] = rows[name][t]
        runtime.load_inputs()
        runtime.step()
        last["served"] = runtime.read_outputs().action

    def plain_step() -> None:
        t = counter["plain"] % reps
        counter["plain"] += 1
        last["plain"] = plain.step(rows, t)

    def same() -> bool:
        return counter["served"] == counter["plain"] and \
            last["served"].tobytes() == last["plain"].astype(np.float32).tobytes()
    return served_step, plain_step, same


def alternate(a: Callable[[], None], b: Callable[[], None], blocks: int, per_block: int) -> Tuple[np.ndarray, ...]:
    """Seconds per call of ``a`` and ``b``, timed in alternating blocks."""
    out_a: List[float] = []
    out_b: List[float] = []
    for _ in range(blocks):
        for fn, out in ((a, out_a), (b, out_b)):
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return np.asarray(out_a), np.asarray(out_b)


def run_onnx(device: torch.device, quick: bool) -> dict:
    from capsule_ros.benchmarks.snapshot import bench_state
    from capsule_ros.runtime.builder import build_policy_runtime
    from capsule_ros.runtime.schema import BufferKind
    from capsule_ros.serving.factory import build_policy
    shape = QUICK if quick else FULL
    result: dict = {"bench": "step", "policy": "onnx", **environment(device), "quick": quick,
                    "model": {"lstm": shape.hidden, "mlp": list(shape.mlp), "obs": OBS, "actions": ACTIONS}}
    if device.type == "cuda":
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            result["not_measured"] = (f"onnxruntime {ort.__version__} here has {ort.get_available_providers()}: the "
                                      "CUDA provider needs onnxruntime-gpu, which this machine does not have")
            return result
    with tempfile.TemporaryDirectory() as tmp:
        model = write_lstm_policy(Path(tmp) / "policy.onnx", shape.hidden, shape.mlp)
        result["model"]["bytes"] = model.stat().st_size
        reps = 300 if quick else 2000
        rows = sensor_rows(reps + 10)
        pairs = {("guarded" if guard else "unguarded"): served_and_plain(model, rows, reps, guard)
                 for guard in (True, False)}
        for served_step, plain_step, _ in pairs.values():
            for _ in range(20):
                served_step()
                plain_step()
        samples: Dict[str, Dict[str, List[float]]] = {v: {"served": [], "plain": [], "ratios": []} for v in pairs}
        per_block = reps // (ROUNDS * BLOCKS)
        for _ in range(ROUNDS):
            for variant, (served_step, plain_step, _) in pairs.items():
                a, b = alternate(served_step, plain_step, blocks=BLOCKS, per_block=per_block)
                samples[variant]["served"] += a.tolist()
                samples[variant]["plain"] += b.tolist()
                samples[variant]["ratios"].append(float(np.median(a) / np.median(b)))
        for variant, sample in samples.items():
            ratios = sample["ratios"]
            result[variant] = {"served_us": pct(np.asarray(sample["served"])),
                               "plain_us": pct(np.asarray(sample["plain"])), "ratio": float(np.median(ratios)),
                               "round_ratios": ratios, "spread": [min(ratios), max(ratios)],
                               "identical_actions": pairs[variant][2]()}
        result["rounds"], result["blocks_per_round"], result["steps_per_block"] = ROUNDS, BLOCKS, per_block
        result["ratio"] = result["guarded"]["ratio"]
        result["target"] = "served step <= 1.1 x the plain ONNX Runtime loop (CPU; median of the rounds' p50 ratios)"
        result["met"] = result["ratio"] <= 1.1
        result["load_average_after"] = list(os.getloadavg())
        config = quadruped_config(model, device="cpu")
        runtime = build_policy_runtime(build_policy(config), config.runtime)
        result["capsule"] = bench_state("onnx" + ("-quick" if quick else ""), runtime.layout, device, 2000)
        result["capsule"]["state_bytes"] = {kind.value: hi - lo for kind in BufferKind
                                            for lo, hi in [runtime.layout.byte_range(kind)] if hi > lo}
    return result


def table(result: dict) -> None:
    if "not_measured" in result:
        print(f"bench step --policy onnx on {result['device']}: not measured: {result['not_measured']}")
        return
    rows = [[variant, result[variant]["served_us"]["p50"], result[variant]["served_us"]["p99"],
             result[variant]["plain_us"]["p50"], result[variant]["plain_us"]["p99"], result[variant]["ratio"],
             "{:.3f}-{:.3f}".format(*result[variant]["spread"])]
            for variant in ("guarded", "unguarded")]
    model = result["model"]
    print_table(f"ONNX policy step on {result['device']} (us): LSTM {model['lstm']}, MLP {model['mlp']}; ratio: "
                f"median of {result['rounds']} rounds", ["served", "p50", "p99", "plain ORT p50", "plain p99",
                                                        "ratio", "rounds' range"], rows)
    capsule = result["capsule"]
    same = all(result[variant]["identical_actions"] for variant in ("guarded", "unguarded"))
    print(f"served / plain = {result['ratio']:.3f} (target <= 1.1: {'met' if result['met'] else 'NOT met'}), "
          f"actions {'bit-identical' if same else 'DIFFERENT'}; "
          f"capsule of {capsule['bytes']} bytes: snapshot {capsule['snapshot_us']:.3g} us, "
          f"restore {capsule['restore_us']:.3g} us, "
          f"limit (one copy) {capsule['limit_us']:.3g} us, ratio {capsule['ratio_to_limit']:.2f}")


def main(args) -> int:
    emit(run_onnx(resolve_device(args.device), args.quick), args.json, table)
    return 0
