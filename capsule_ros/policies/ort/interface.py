"""What each input and output of an ONNX model is for, and the arena buffer it binds to.

A recurrent controller exported to ONNX keeps its state outside the model: the state goes
in as inputs and comes back as outputs (Isaac Lab: ``obs, h_in, c_in -> actions, h_out,
c_out``; sb3-contrib's RecurrentPPO exported with its state: ``obs, lstm_h, lstm_c,
episode_starts -> actions, lstm_h_out, lstm_c_out``). ``resolve_roles`` sorts them:

- state pairs ``'<input>:<output>'`` from ``policy.onnx.state``; when it is empty, every
  input ``<b>_in`` with an output ``<b>_out`` and every input ``<n>`` with an output
  ``<n>_out`` (Isaac Lab's and sb3-contrib's names). Both sides of a pair have one shape
  and dtype;
- the episode-start flag (``policy.onnx.episode_start``, default: an input named
  ``episode_starts``, ``episode_start`` or ``is_init``): 1 on the first step of an
  episode, 0 after, kept in the arena;
- the observation input (``policy.onnx.observation``, default: the one input left, or
  the one named ``obs``), float32, fed by the observation terms;
- the action output (``policy.onnx.action``, default: the one output left, or the one
  named ``actions``), float32;
- any other output (a value estimate, say) is bound to an output buffer too; any other
  input is refused, naming it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from capsule_ros.policies.ort.model import OnnxModel, OnnxModelError, TensorInfo

EPISODE_START_NAMES = ("episode_starts", "episode_start", "is_init")
OBSERVATION_NAMES = ("obs", "observation", "observations")   # chosen among several free inputs
ACTION_NAMES = ("actions", "action")                          # chosen among several free outputs
PREFIX = "onnx."                                # arena buffers of the model's tensors: onnx.<tensor name>


def buffer_name(tensor: str) -> str:
    """The arena buffer of a model tensor (ports' names have no dot, so these never clash)."""
    return PREFIX + re.sub(r"[^A-Za-z0-9_.:-]", "_", tensor)


@dataclass(frozen=True)
class StatePair:
    """A state the model takes as ``input`` and returns as ``output``; ``in_place``: the
    output is written straight into the input's buffer (else into its own, then one copy)."""

    input: TensorInfo
    output: TensorInfo
    in_place: bool = False


@dataclass(frozen=True)
class ModelRoles:
    """The model's tensors by role (see the module docstring)."""

    observation: TensorInfo
    action: TensorInfo
    pairs: Tuple[StatePair, ...]
    episode_start: Optional[TensorInfo]
    extra_outputs: Tuple[TensorInfo, ...]

    def describe(self) -> dict:
        """JSON-able (part of the capsule fingerprint)."""
        return {"observation": self.observation.describe(), "action": self.action.describe(),
                "state": [{"input": p.input.describe(), "output": p.output.describe(),
                           "binding": "in_place" if p.in_place else "copy"} for p in self.pairs],
                "episode_start": self.episode_start.describe() if self.episode_start else None,
                "extra_outputs": [t.describe() for t in self.extra_outputs]}


def _recognised_pairs(model: OnnxModel) -> List[Tuple[str, str]]:
    outputs = {t.name for t in model.outputs}
    pairs = []
    for t in model.inputs:
        base = t.name[:-3] if t.name.endswith("_in") else None
        for candidate in ([f"{base}_out"] if base else []) + [f"{t.name}_out"]:
            if candidate in outputs:
                pairs.append((t.name, candidate))
                break
    return pairs


def resolve_roles(model: OnnxModel, state: Sequence[str], observation: str, action: str, episode_start: str,
                  where: str) -> ModelRoles:
    """The roles of ``model``'s tensors (see the module docstring); OnnxModelError naming
    the tensor and the setting to change."""
    inputs = {t.name: t for t in model.inputs}
    outputs = {t.name: t for t in model.outputs}
    shown = (f"(inputs {[t.describe() for t in model.inputs]}, outputs {[t.describe() for t in model.outputs]})")
    if state:
        names = []
        for entry in state:
            left, sep, right = entry.partition(":")
            if not sep or not left or not right:
                raise OnnxModelError(f"{where}: policy.onnx.state entry {entry!r}: expected '<input>:<output>'")
            names.append((left, right))
    else:
        names = _recognised_pairs(model)
    pairs = []
    for left, right in names:
        if left not in inputs or right not in outputs:
            missing = f"input {left!r}" if left not in inputs else f"output {right!r}"
            raise OnnxModelError(f"{where}: policy.onnx.state pairs {left!r} with {right!r}, but the model has no "
                                 f"{missing} {shown}")
        a, b = inputs[left], outputs[right]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise OnnxModelError(f"{where}: state {a.describe()} comes back as {b.describe()}; a state pair needs one "
                                 "shape and dtype on both sides")
        pairs.append(StatePair(a, b))
    paired_in = {p.input.name for p in pairs}
    paired_out = {p.output.name for p in pairs}
    if len(paired_in) != len(pairs) or len(paired_out) != len(pairs):
        raise OnnxModelError(f"{where}: policy.onnx.state uses a tensor in two pairs: {list(state)}")
    start: Optional[TensorInfo] = None
    if episode_start:
        if episode_start not in inputs or episode_start in paired_in:
            raise OnnxModelError(f"{where}: policy.onnx.episode_start = {episode_start!r} is not a free input of the "
                                 f"model {shown}")
        start = inputs[episode_start]
    else:
        start = next((inputs[n] for n in EPISODE_START_NAMES if n in inputs and n not in paired_in), None)
    free_in = [t for t in model.inputs if t.name not in paired_in and (start is None or t.name != start.name)]
    free_out = [t for t in model.outputs if t.name not in paired_out]
    obs = _one(free_in, observation, OBSERVATION_NAMES, "input", "policy.onnx.observation", where, shown)
    act = _one(free_out, action, ACTION_NAMES, "output", "policy.onnx.action", where, shown)
    others = [t.name for t in free_in if t.name != obs.name]
    if others:
        raise OnnxModelError(f"{where}: the model's inputs {others} are neither the observation ({obs.name!r}), a "
                             "state "
                             "(policy.onnx.state) nor the episode-start flag (policy.onnx.episode_start); capsule_ros "
                             f"cannot feed them {shown}")
    for tensor, what in ((obs, "observation input"), (act, "action output")):
        if tensor.dtype != torch.float32:
            raise OnnxModelError(f"{where}: the {what} {tensor.describe()} must be float32")
    if start is not None and not start.dtype.is_floating_point and start.dtype != torch.int64:
        raise OnnxModelError(f"{where}: the episode-start flag {start.describe()} must be a float or int64 tensor")
    extra = tuple(t for t in free_out if t.name != act.name)
    return ModelRoles(obs, act, tuple(pairs), start, extra)


def _one(candidates: List[TensorInfo], chosen: str, usual: Sequence[str], what: str, setting: str, where: str,
         shown: str) -> TensorInfo:
    """The tensor ``chosen`` names, else the only candidate, else one with a usual name."""
    by_name: Dict[str, TensorInfo] = {t.name: t for t in candidates}
    if chosen:
        if chosen not in by_name:
            raise OnnxModelError(f"{where}: {setting} = {chosen!r} is not a free {what} of the model {shown}")
        return by_name[chosen]
    if len(candidates) > 1:
        for name in usual:
            if name in by_name:
                return by_name[name]
    if len(candidates) != 1:
        raise OnnxModelError(f"{where}: cannot tell which {what} is the {setting.rsplit('.', 1)[-1]}: "
                             f"{sorted(by_name) or 'none'} are left after the state pairs; set {setting} {shown}")
    return candidates[0]
