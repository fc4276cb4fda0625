"""Where capsule_ros's VLA chunk and LeRobot's first differ on a device: every module's
output, side by side, in LeRobot's call order.

    CAPSULE_ROS_WITHOUT_ROS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=.:examples/gru_policy \\
        python3 bench/compare_vla_layers.py OUT [--case smolvla-1cam] [--quick] [--device cuda]

One process, LeRobot 0.6.1 importable in it (on the GPU machine it travels as wheels). Writes
the case's checkpoint as ``capsule-ros bench vla`` does, then plans the episode's first chunk
for one observation four ways:

- LeRobot's ``predict_action`` with torch's deterministic algorithms on (capsule_ros's
  runtime setting) and off, with forward hooks on every module of its model;
- capsule_ros's session with ``runtime.cuda_graphs: false`` (the plan run eagerly, hooked the
  same way) and with its captured graphs (the product).

It reports the first action of each, whether the weights are the same bytes in the same
dtypes on both sides, and, for every module both models have (LeRobot's names), whether its
first call's input and output are equal bit for bit: the first module whose input is equal
and output is not is an operation that computes differently; a module whose input differs
while the module before it agreed points at the functional code between them. Writes
``OUT/compare_vla_layers.txt``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from capsule_ros.benchmarks import vla
from capsule_ros.benchmarks.chunking import at, observations, side_session
from capsule_ros.benchmarks.common import resolve_device, write_report

# LeRobot's side, imported before torch runs (they pin the CPU numerics level)
from tools.lerobot_fixtures.make_fixtures import predict_action
from tools.lerobot_fixtures.make_vla_fixtures import CounterFlowNoise, load_policy
from tools.lerobot_fixtures.pi_scaled import load_pi

Record = Dict[str, List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]]
CALLS = 2                     # calls kept per module (the expert's run once per denoising step)


def first_tensor(values: Any) -> Optional[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (tuple, list)):
        for value in values:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def hook_modules(model: torch.nn.Module, record: Record, order: List[str]):
    """Forward hooks keeping each module's first ``CALLS`` (input, output) pairs, not while a
    graph is being captured."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, args, kwargs, output, name=name):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return
            calls = record.setdefault(name, [])
            if len(calls) >= CALLS:
                return
            if not calls:
                order.append(name)
            given, made = first_tensor(args) if args else first_tensor(kwargs), first_tensor(output)
            calls.append((None if given is None else given.detach().clone(),
                          None if made is None else made.detach().clone()))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return handles


def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Tuple[str, float]:
    """('=' | '!=' | 'shape' | '-', max |a - b|)."""
    if a is None or b is None:
        return "-", 0.0
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}", float("nan")
    if a.dtype.is_floating_point:
        equal = torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                            b.view(torch.int16 if b.element_size() == 2 else torch.int32))
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    else:
        equal, diff = torch.equal(a, b), 0.0
    return ("=" if equal else "!="), diff


def lerobot_first_action(written: vla.Written, obs: Dict[str, np.ndarray], device: torch.device,
                         deterministic: bool, record: Optional[Record], order: List[str]):
    """LeRobot's policy, loaded as select_action_loop.py loads it, planning step 0."""
    extra = dict(zip(written.extra[::2], written.extra[1::2], strict=True))
    load = load_policy if written.config.policy.kind == "lerobot_smolvla" else load_pi
    policy, pre, post = load(written.checkpoint, Path(extra["--vlm"]), device=str(device))
    noise = CounterFlowNoise(policy)
    noise.at(0, 0, 0)
    policy.reset()
    pre.reset()
    post.reset()
    handles = hook_modules(policy.model, record, order) if record is not None else []
    torch._C._set_deterministic_algorithms(deterministic, warn_only=False)
    try:
        action = predict_action({key: at(value, 0) for key, value in obs.items()}, policy, device, pre, post,
                                use_amp=False, task=extra.get("--task") or None)
    finally:
        torch._C._set_deterministic_algorithms(True, warn_only=False)
        for handle in handles:
            handle.remove()
    return policy.model, action.reshape(-1).float().cpu().numpy()


def capsule_first_action(written: vla.Written, obs: Dict[str, np.ndarray], device: torch.device, graphs: bool,
                         record: Optional[Record], their_model: torch.nn.Module) -> Tuple[np.ndarray, List[str]]:
    """capsule_ros's session planning step 0 (eagerly where ``graphs`` is off), and its
    weights against LeRobot's (before the session releases them)."""
    config = written.config
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, cuda_graphs=graphs))
    session = side_session(config, device, "sync", vla.ASYNC_RATE_HZ, paced=False, steps=2)
    policy = session.parts.runtime.policy
    model = policy.weight_modules()["model"]
    handles = hook_modules(model, record, []) if record is not None else []
    try:
        for key, value in obs.items():
            session.loop.write_input(written.ports_of[key], at(value, 0))
        values = np.asarray(session.loop.tick().values, dtype=np.float32).reshape(-1)
    finally:
        for handle in handles:
            handle.remove()
    weights = compare_weights(their_model, model)
    session.release()
    return values, weights


def compare_weights(theirs: torch.nn.Module, mine: torch.nn.Module) -> List[str]:
    mine_params = dict(mine.named_parameters())
    lines, checked = [], 0
    for name, param in theirs.named_parameters():
        other = mine_params.get(name)
        if other is None:
            continue
        checked += 1
        verdict, diff = same(param.data, other.data)
        if verdict != "=":
            lines.append(f"  weight {name}: {verdict} (max {diff:.3g})")
    return [f"weights with the same name on both sides: {checked}, different: {len(lines)}", *lines[:20]]


def compare_records(theirs: Record, order: List[str], mine: Record, limit: int = 60) -> List[str]:
    lines = []
    blamed = None
    previous_out_equal = True
    shown = 0
    for name in order:
        if name not in mine:
            continue
        (their_in, their_out), (my_in, my_out) = theirs[name][0], mine[name][0]
        in_verdict, in_diff = same(their_in, my_in)
        out_verdict, out_diff = same(their_out, my_out)
        if blamed is None and out_verdict != "=":
            if in_verdict == "=":
                blamed = f"{name}: equal input, different output (max {out_diff:.3g}): the operation itself"
            elif previous_out_equal:
                blamed = f"{name}: its input already differs (max {in_diff:.3g}) though the module before agreed: " \
                         "the code between them"
        previous_out_equal = out_verdict == "="
        if out_verdict != "=" and shown < limit:
            shown += 1
            lines.append(f"  {name}: input {in_verdict} ({in_diff:.3g}), output {out_verdict} ({out_diff:.3g})")
    only_theirs = [n for n in order if n not in mine]
    return [f"modules compared: {sum(1 for n in order if n in mine)}, LeRobot's only: {len(only_theirs)} "
            f"({', '.join(only_theirs[:6])}{' ...' if len(only_theirs) > 6 else ''})",
            f"first divergence: {blamed or 'none'}", *lines]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--case", default="smolvla-1cam", choices=sorted(vla.CASES))
    parser.add_argument("--quick", action="store_true", help="the tiny sizes")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = resolve_device(args.device)
    case = vla.CASES[args.case]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    lines = [f"{args.case}{' (tiny)' if args.quick else ''} on {where}, torch {torch.__version__}, "
             f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}"]
    with tempfile.TemporaryDirectory() as tmp:
        written = vla.write_case(case, Path(tmp) / case.name, args.quick, device, Path(sys.executable), None)
        joints = int(written.config.ports[written.ports_of[vla.lerobot_pi.STATE]].shape[0])
        obs = observations(2, written.camera, joints=joints, cameras=written.camera_keys)
        theirs: Record = {}
        order: List[str] = []
        their_model, det_action = lerobot_first_action(written, obs, device, True, theirs, order)
        default_record: Record = {}
        _, default_action = lerobot_first_action(written, obs, device, False, default_record, [])
        graph_action, weights = capsule_first_action(written, obs, device, True, None, their_model)
        mine: Record = {}
        eager_action, _ = capsule_first_action(written, obs, device, False, mine, their_model)
        actions = {"capsule_ros graph": graph_action, "capsule_ros eager": eager_action,
                   "LeRobot deterministic": det_action, "LeRobot default algorithms": default_action}
        for label, action in actions.items():
            lines.append(f"{label:28s} first action {np.array2string(action, precision=6)}")
        for a, b in (("capsule_ros graph", "capsule_ros eager"), ("capsule_ros eager", "LeRobot deterministic"),
                     ("LeRobot deterministic", "LeRobot default algorithms")):
            equal = np.array_equal(actions[a].view(np.uint32), actions[b].view(np.uint32))
            lines.append(f"{a} vs {b}: {'bit-identical' if equal else 'differ'} "
                         f"(max {float(np.abs(actions[a] - actions[b]).max()):.3g})")
        lines += weights
        lines.append("capsule_ros eager against LeRobot deterministic, module by module:")
        lines += compare_records(theirs, order, mine)
        lines.append("LeRobot default algorithms against LeRobot deterministic, module by module:")
        lines += compare_records(theirs, order, default_record, limit=15)
    write_report(args.out, "compare_vla_layers.txt", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
