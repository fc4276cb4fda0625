"""What each input and output of an ONNX model is for, and the arena buffer it binds to.

A recurrent controller exported to ONNX keeps its state outside the model: the state goes
in as inputs and comes back as outputs (Isaac Lab: ``obs, h_in, c_in -> actions, h_out,
c_out``; sb3-contrib's RecurrentPPO exported with its state: ``obs, lstm_h, lstm_c,
episode_starts -> actions, lstm_h_out, lstm_c_out``). ``resolve_roles`` sorts them by
``RULES``, the kind's table in the binding vocabulary (``capsule_ros.policies.binding``):

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
from typing import Optional, Sequence, Tuple

import torch

from capsule_ros.policies.binding import BindingRules, Count, PairRule, Role, RoleRule, Side, Tensor, Wording, bind
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


RULES = BindingRules(
    pairs=PairRule("policy.onnx.state", patterns=(("{}_in", "{}_out"), ("{}", "{}_out"))),
    roles=(
        RoleRule(Role.OBSERVATION, Side.INPUT, Count.ONE, setting="policy.onnx.observation", usual=OBSERVATION_NAMES,
                 dtypes=(torch.float32,), allowed="float32", noun="observation input"),
        RoleRule(Role.ACTION, Side.OUTPUT, Count.ONE, setting="policy.onnx.action", usual=ACTION_NAMES,
                 dtypes=(torch.float32,), allowed="float32", noun="action output"),
        RoleRule(Role.EPISODE_START, Side.INPUT, Count.OPTIONAL, setting="policy.onnx.episode_start",
                 usual=EPISODE_START_NAMES, dtypes=(torch.int64,), floats=True, allowed="a float or int64 tensor",
                 noun="episode-start flag"),
        RoleRule(Role.EXTRA_OUTPUT, Side.OUTPUT, Count.ANY),
    ),
    wording=Wording(leftover="{where}: the model's inputs {names} are neither the observation "
                             "({bound[observation]!r}), a state (policy.onnx.state) nor the episode-start flag "
                             "(policy.onnx.episode_start); capsule_ros cannot feed them {shown}"),
)


def resolve_roles(model: OnnxModel, state: Sequence[str], observation: str, action: str, episode_start: str,
                  where: str) -> ModelRoles:
    """The roles of ``model``'s tensors (see the module docstring) by ``RULES``;
    OnnxModelError naming the tensor and the setting to change."""
    table = bind(RULES, inputs=[Tensor.of(t) for t in model.inputs], outputs=[Tensor.of(t) for t in model.outputs],
                 pairs=state, chosen={"policy.onnx.observation": observation, "policy.onnx.action": action,
                                      "policy.onnx.episode_start": episode_start},
                 where=where, error=OnnxModelError)
    pairs = tuple(StatePair(b.tensor.source, b.partner.source) for b in table.of(Role.STATE) if b.partner)
    start = table.one(Role.EPISODE_START)
    return ModelRoles(table.sources(Role.OBSERVATION)[0], table.sources(Role.ACTION)[0], pairs,
                      start.tensor.source if start else None, table.sources(Role.EXTRA_OUTPUT))
