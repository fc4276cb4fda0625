"""`capsule-ros bench startup`: launch to first action of ``policy_node``, beside the time
to load the same model the plain way and get one action from it, side by side in one run.

Cases (``--cases``, default all): ``default`` (config/policy.yaml, the shipped weights),
``onnx`` (config/onnx_quadruped.yaml serving an Isaac Lab-style recurrent policy.onnx:
LSTM 256, about 3 KiB of state, with the default capsule budgets, 256 + 1024 MiB, so
about 440,000 capsule slots), ``act`` (the ACT checkpoint of ``bench step --policy act``:
ALOHA shapes, a 480 x 640 camera) and ``diffusion`` (Diffusion Policy's default U-Net and
10 inference steps on a 96 x 96 camera, the shape of LeRobot's PushT checkpoint);
``--quick``: small networks and cameras.

- ``served``: the installed ``policy_node`` launched as a process with the case's
  parameters (autostart: configure and activate); this process publishes one message on
  every port once the node subscribes (the trigger port 10 ms after the others), again
  every 50 ms, and
  times the launch to the first policy action on ``~/action`` (not a safe action). The node's own log gives the
  phases: launch to ``configured`` (imports, rclpy, the policy built and its weights
  read) and to ``serving`` (activate: arena, capsule pools, state check, rehearsal).
- ``plain``: a fresh Python process (``startup_plain.py``) that loads the same model
  (ONNX Runtime only for the ONNX model; the kind's own model code and weights in plain
  torch for the others: no arena, runtime, capsules or ROS) and computes one action,
  timed from its launch to its output. A torch side computes at the CPU vector level the
  node pins (``runtime.numerics``: the same kernels, so that the difference is start-up);
  ``plain_native`` is the same process at this CPU's own level, for the reader.
- ``import torch``: a process that only imports torch, for the reader (an ONNX policy is
  served over a torch arena; its plain side never imports torch).

Target: served <= ``BUDGET_S`` + plain + graph capture (none on a CPU: the step runs
eagerly), per case, on medians (``met``). ``met_but_state_check``: the same without the
time of the start-up state check (``runtime.state_check``: five steps a plain load never
runs; the node logs it). A chunking policy's node runs it beside serving on a CPU
(``runtime.state_check_timing: auto``; ``state_check_beside``: in every round), where its
plans are then not part of the launch to the first action. The sides alternate in ``ROUNDS`` rounds so that a busy
machine slows them alike; the spread (min..max) and the load average before and after
are recorded. CPU only: it launches policy_node (ROS), which the GPU machine lacks.
"""
from __future__ import annotations

import array
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import yaml

from capsule_ros.benchmarks.common import config_path, emit, environment, print_table, resolve_device
from capsule_ros.config import load_params_file
from capsule_ros.runtime import numerics

BUDGET_S = 1.5
ROUNDS = 5
CASES = ("default", "onnx", "act", "diffusion")
PLAIN = Path(__file__).with_name("startup_plain.py")
FIRST_ACTION_TIMEOUT_S = 600.0
STATE_CHECK_WAIT_S = 120.0           # after the first action: a check beside serving logs its verdict
PUBLISH_PERIOD_S = 0.05


@dataclass
class Case:
    name: str
    summary: str
    params: Dict[str, Any]          # the node's parameters, whole
    plain: List[str]                # startup_plain.py's arguments


def _case(name: str, tmp: Path, quick: bool) -> Case:
    """Write the case's model into ``tmp`` and describe both sides."""
    from capsule_ros.capsules.config import CapsuleStoreConfig
    params: Dict[str, Any]
    if name == "default":
        params = load_params_file(config_path("policy.yaml"))
        summary = "config/policy.yaml, shipped weights"
    elif name == "onnx":
        from capsule_ros.benchmarks.onnx_step import FULL, QUICK, write_lstm_policy
        shape = QUICK if quick else FULL
        model = write_lstm_policy(tmp / "policy.onnx", shape.hidden, shape.mlp)
        params = load_params_file(config_path("onnx_quadruped.yaml"))
        params["policy"]["onnx"]["model"] = str(model)
        defaults = CapsuleStoreConfig()            # the budgets a user who sets none gets
        params["capsules"].update(device_budget_mb=defaults.device_budget_mb, host_budget_mb=defaults.host_budget_mb)
        summary = f"onnx_quadruped.yaml, LSTM {shape.hidden} + MLP {list(shape.mlp)}, default capsule budgets"
    elif name in ("act", "diffusion"):
        from capsule_ros.benchmarks.lerobot_act import serving_params, write_act_checkpoint
        from capsule_ros.benchmarks.lerobot_diffusion import write_diffusion_checkpoint
        if name == "act":
            checkpoint = write_act_checkpoint(tmp / "act", quick=quick)
        else:
            checkpoint = write_diffusion_checkpoint(tmp / "diffusion", (96, 128) if quick else (96, 96), quick=quick)
        params = serving_params(checkpoint)
        params["control"]["input_log_steps"] = 600      # as docs/lerobot.md sizes a camera policy's log
        params["control"]["deadline_ms"] = 0.0          # a CPU plans a chunk slower than any control period
        config = json.loads((checkpoint / "config.json").read_text())
        camera = config["input_features"]["observation.images.top"]["shape"][1:]
        summary = f"{config['type']}, {config['vision_backbone']}, camera {camera[0]} x {camera[1]}"
    else:
        raise SystemExit(f"capsule-ros bench startup: --cases {name}: the cases are {', '.join(CASES)}")
    params["capsules"]["directory"] = str(tmp / f"{name}-capsules")
    params["runtime"]["device"] = "cpu"
    if name == "onnx":
        plain = ["onnx", params["policy"]["onnx"]["model"]]
    else:
        (tmp / f"{name}.json").write_text(json.dumps(params))
        plain = ["torch", str(tmp / f"{name}.json")]
    return Case(name, summary, params, plain)


# -- the plain side ---------------------------------------------------------------------------------
def time_plain(case: Case, native: bool = False) -> float:
    """Seconds from launching the plain process to its first action (``native``: a torch
    side at this CPU's own vector level rather than the node's)."""
    args, env = list(case.plain), _env()
    if native:
        args[0] += "-native"
        for name in numerics.PIN_VARIABLES:         # this process's own pin is in its environment
            env.pop(name, None)
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(PLAIN), *args], capture_output=True, text=True,
                         timeout=FIRST_ACTION_TIMEOUT_S, env=env)
    seconds = time.monotonic() - start
    if out.returncode != 0 or "first action" not in out.stdout:
        raise SystemExit(f"the plain {case.name} load failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return seconds


def time_torch_import() -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=_env())
    return time.monotonic() - start


def _env() -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


# -- the served side --------------------------------------------------------------------------------
def port_message(port: Any, stamp: Any) -> Any:
    """A message that fills ``port`` (a PortConfig) with zeros: its type, its fields
    (sequences sized by its names or shape), joint names, an image of its shape and
    encoding; ``stamp`` in its header."""
    from capsule_ros.ros.robot_io import message_class
    msg = message_class(port.type)()
    if hasattr(msg, "header"):
        msg.header.stamp = stamp
    if port.type.endswith("/Image"):
        height, width, channels = port.shape
        msg.height, msg.width, msg.encoding = height, width, port.encodings[0]
        msg.step = width * channels
        msg.data = bytes(height * width * channels)
        return msg
    if port.names:
        msg.name = list(port.names)
    per_field = len(port.names) if port.names else int(np.prod(port.shape)) // max(len(port.fields), 1)
    for path in port.fields:
        *parents, leaf = path.split(".")
        owner = msg
        for part in parents:
            owner = getattr(owner, part)
        if isinstance(getattr(owner, leaf), (list, array.array, np.ndarray)):
            setattr(owner, leaf, [0.0] * per_field)
    return msg


class Feeder:
    """Publishes every port of a node's parameters and waits for its first action."""

    def __init__(self, node: Any, namespace: str, params: Dict[str, Any]):
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        from capsule_ros.msg import Action
        from capsule_ros.ros.robot_io import message_class
        from capsule_ros.serving.config import ServingConfig
        config = ServingConfig.from_params(params)
        self.node = node
        trigger = config.control.trigger_port
        names = sorted(config.ports, key=lambda name: name == trigger)       # the trigger port last
        qos = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
        self.ports = [(config.ports[name], node.create_publisher(
            message_class(config.ports[name].type), _topic(namespace, config.ports[name].topic), qos))
            for name in names]
        self.first: Optional[float] = None
        self._got = threading.Event()
        node.create_subscription(Action, f"{namespace}/capsule_policy/action", self._on_action, 10)

    def _on_action(self, msg: Any) -> None:
        if self.first is None and msg.source == msg.SOURCE_POLICY:      # not a safe action
            self.first = time.monotonic()
            self._got.set()

    def run(self, until: float, alive) -> Optional[float]:
        """Publish once the node subscribes, every ``PUBLISH_PERIOD_S``, until its first
        action (its monotonic time) or ``until``; None when the node died or never acted.
        The trigger port goes 10 ms after the others (separate topics arrive in any order,
        and a trigger before every port has a value steps nothing)."""
        while time.monotonic() < until and not self._got.is_set():
            if not alive():
                return None
            if all(pub.get_subscription_count() > 0 for _, pub in self.ports):
                stamp = self.node.get_clock().now().to_msg()
                for i, (port, pub) in enumerate(self.ports):
                    if i == len(self.ports) - 1:
                        self._got.wait(0.01)
                    pub.publish(port_message(port, stamp))
                self._got.wait(PUBLISH_PERIOD_S)
            else:
                self._got.wait(0.005)
        return self.first


def _topic(namespace: str, topic: str) -> str:
    return topic if topic.startswith("/") else f"{namespace}/{topic}"


LOG_TIME = re.compile(r"\[(\d+\.\d+)\] \[[^\]]*\]: (.*)")


def log_phases(log: str, launched_wall: float) -> Dict[str, Any]:
    """Seconds from the launch to the node's ``configured`` and ``serving`` lines, and its
    capsule pools' slab counts (from its log)."""
    phases: Dict[str, Any] = {}
    for line in log.splitlines():
        found = LOG_TIME.search(line)
        if not found:
            continue
        stamp, text = float(found.group(1)), found.group(2)
        if text.startswith("configured:"):
            phases["configured_s"] = stamp - launched_wall
        elif text.startswith("serving on"):
            phases["serving_s"] = stamp - launched_wall
        check = re.search(r"state check: .* in ([0-9.]+) ms", text)
        if check:
            phases["state_check_s"] = float(check.group(1)) / 1e3
        if text.startswith("[serving.statecheck] state check passed, beside serving"):
            phases["state_check_beside"] = 1.0
        pools = re.search(r"capsule pools: (\d+) device slab\(s\), (\d+) host slab\(s\)", text)
        if pools:
            phases["slabs"] = int(pools.group(1)) + int(pools.group(2))
    if "configured_s" in phases and "serving_s" in phases:
        phases["activate_s"] = phases["serving_s"] - phases["configured_s"]
    return phases


def time_served(case: Case, tmp: Path, round_no: int) -> Dict[str, Any]:
    """Launch policy_node with the case's parameters: seconds to its first action, and the
    phases of its log. The publishers are a fresh participant's (a context of their own), as
    sensor drivers launched with the node are: a participant that had seen the earlier
    rounds' nodes gave a new one its endpoints up to 2.4 s after it subscribed (Fast DDS;
    with a fresh one, the first action came about 20 ms after the node was serving)."""
    import rclpy

    from capsule_ros.ros.processes import start_policy_node
    from capsule_ros.ros.spinning import SpunNode
    namespace = f"/bench_startup_{case.name}_{round_no}"
    params_file = tmp / f"{case.name}-params.yaml"
    params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": case.params}}))
    context = rclpy.Context()
    rclpy.init(context=context)
    client = SpunNode(rclpy, "bench_startup_client", context=context)
    feeder = Feeder(client.node, namespace, case.params)
    launched_wall, launched = time.time(), time.monotonic()
    proc = start_policy_node(tmp, {}, namespace=namespace, params_file=params_file, tag=f"{case.name}-{round_no}")
    try:
        first = feeder.run(launched + FIRST_ACTION_TIMEOUT_S, proc.alive)
        deadline = time.monotonic() + STATE_CHECK_WAIT_S
        while first is not None and proc.alive() and not state_check_settled(proc.log()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)            # stopped before its verdict, a check beside serving would log none
    finally:
        code = proc.stop()
        client.close()
        context.try_shutdown()
    if first is None:
        raise SystemExit(f"policy_node ({case.name}) gave no action (exit {code}):\n{proc.log()[-3000:]}")
    return {"served_s": first - launched, **log_phases(proc.log(), launched_wall)}


def state_check_settled(log: str) -> bool:
    """Whether a node's log holds its start-up state check's verdict: passed or failed beside
    serving, or the check's own line before the node was serving (checked before serving)."""
    if re.search(r"state check (passed|failed), beside serving", log):
        return True
    check, serving = re.search(r"state check: \d+ steps", log), re.search(r"\]: serving on", log)
    return check is not None and serving is not None and check.start() < serving.start()


# -- the run ----------------------------------------------------------------------------------------
def _spread(values: Sequence[float]) -> Dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def run(cases: Sequence[str] = CASES, quick: bool = False, rounds: int = ROUNDS) -> dict:
    device = resolve_device("cpu")
    with tempfile.TemporaryDirectory(prefix="capsule-bench-startup-") as directory:
        return _run(cases, quick, rounds, device, Path(directory))


def _run(cases: Sequence[str], quick: bool, rounds: int, device: Any, tmp: Path) -> dict:
    prepared = [_case(name, tmp, quick) for name in cases]
    load_before = list(os.getloadavg())
    samples: Dict[str, Dict[str, List[float]]] = {c.name: {} for c in prepared}
    torch_import: List[float] = []
    for round_no in range(rounds):
        torch_import.append(time_torch_import())
        for case in prepared:
            sides = ["plain", "served"] + (["plain_native"] if case.plain[0] == "torch" else [])
            for side in sides if round_no % 2 == 0 else reversed(sides):
                got = ({f"{side}_s": time_plain(case, native=side == "plain_native")} if side != "served"
                       else time_served(case, tmp, round_no))
                for key, value in got.items():
                    samples[case.name].setdefault(key, []).append(value)
    result: Dict[str, Any] = {"bench": "startup", **environment(device), "quick": quick, "rounds": rounds,
                              "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
                              "budget_s": BUDGET_S, "import_torch_s": _spread(torch_import), "cases": {}}
    for case in prepared:
        got = samples[case.name]
        row: Dict[str, Any] = {"summary": case.summary, "slabs": int(got["slabs"][0]) if got.get("slabs") else 0,
                               "state_check_beside": len(got.get("state_check_beside", [])) == rounds}
        for key in ("served_s", "plain_s", "plain_native_s", "configured_s", "serving_s", "activate_s",
                    "state_check_s"):
            if got.get(key):
                row[key] = _spread(got[key])
        row["graph_capture_s"] = 0.0                 # a CPU runs the step eagerly: nothing is captured
        row["target_s"] = BUDGET_S + row["plain_s"]["median"] + row["graph_capture_s"]
        row["met"] = bool(row["served_s"]["median"] <= row["target_s"])
        check = 0.0 if row["state_check_beside"] else row.get("state_check_s", {"median": 0.0})["median"]
        row["met_but_state_check"] = bool(row["served_s"]["median"] - check <= row["target_s"])
        result["cases"][case.name] = row
    result["met"] = all(row["met"] for row in result["cases"].values())
    return result


def table(result: dict) -> None:
    def cell(spread: Optional[Dict[str, float]]) -> str:
        return f"{spread['median']:.2f} ({spread['min']:.2f}..{spread['max']:.2f})" if spread else "-"
    rows = []
    for name, row in result["cases"].items():
        rows.append([name, cell(row["served_s"]), cell(row["plain_s"]), cell(row.get("plain_native_s")),
                     f"{row['target_s']:.2f}",
                     "yes" if row["met"] else "NO", cell(row.get("configured_s")), cell(row.get("activate_s")),
                     cell(row.get("state_check_s")), "yes" if row["met_but_state_check"] else "NO", row["slabs"]])
    print_table(f"launch to first action, s: median (min..max) of {result['rounds']} rounds; import torch alone "
                f"{cell(result['import_torch_s'])} s; load {result['load_average_before'][0]:.1f} -> "
                f"{result['load_average_after'][0]:.1f}",
                ["case", "policy_node", "plain load", "plain, native level", "target", "met", "to configured",
                 "activate", "state check", "met but the check", "slabs"], rows)


def main(args) -> int:
    if args.device not in ("auto", "cpu"):
        raise SystemExit("capsule-ros bench startup: CPU only (it launches policy_node, and the GPU machine has "
                         "no ROS)")
    cases = [c.strip() for c in (args.cases or ",".join(CASES)).split(",") if c.strip()]
    emit(run(cases, args.quick, 2 if args.quick else ROUNDS), args.json, table)
    return 0
