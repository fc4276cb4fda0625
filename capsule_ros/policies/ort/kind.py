"""``policy.kind: onnx``: the settings section ``policy.onnx`` and the build (docs/onnx.md
is the guide)::

    policy:
      kind: onnx
      weights: ''                              # the model carries its weights
      onnx:
        model: /robot/exported/policy.onnx
        observations: ['base_ang_vel:imu.angular_velocity scale=0.25', 'projected_gravity:imu.orientation',
                       'generated_commands:cmd_vel', 'joint_pos_rel:joints.position',
                       'joint_vel_rel:joints.velocity scale=0.05', 'last_action']
        default_joint_pos: [0.1, -0.1, ...]
        action_scale: [0.25]
        use_default_offset: true

``build`` reads the model's graph (``model.read_model``), sorts its tensors by role
(``interface.resolve_roles``), parses the observation terms against the ports and
decides which state outputs can be written in place, each step raising a ConfigError
that names the setting before the next one starts; then the CPU session is made.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

from capsule_ros.config import ConfigSection, setting
from capsule_ros.errors import ConfigError
from capsule_ros.policies.ort.interface import resolve_roles
from capsule_ros.policies.ort.model import read_model
from capsule_ros.policies.ort.observations import ObservationPlan
from capsule_ros.policies.ort.policy import ActionMap, OnnxPolicy, SessionSettings, decide_in_place
from capsule_ros.policies.registry import BuildContext, PolicyKind


@dataclass(frozen=True)
class OnnxConfig(ConfigSection):
    """An ONNX model run by ONNX Runtime, its observation terms and its action map (docs/onnx.md)."""

    SECTION = "policy.onnx"

    model: str = setting("", "the .onnx file (an external data file beside it is read too); its bytes are part of the "
                         "capsule fingerprint", read_only=True)
    execution_provider: str = setting("cpu", "ONNX Runtime execution provider: cpu (runtime.device: cpu) or cuda "
                                      "(runtime.device: cuda; needs onnxruntime-gpu)", choices=("cpu", "cuda"),
                                      read_only=True)
    optimization: str = setting("all", "ONNX Runtime graph optimisation level", choices=("disable", "basic",
                                                                                           "extended", "all"),
                                read_only=True)
    threads: int = setting(1, "ONNX Runtime intra-op threads (0 = its default, every core)", low=0, high=1024,
                           read_only=True)
    cuda_graph: str = setting("auto", "CUDA provider: capture the run as a CUDA graph: auto (when the model allows it, "
                              "else without one and a warning), on (refuse a model it cannot take), off",
                              choices=("auto", "on", "off"), read_only=True)
    dims: Tuple[str, ...] = setting((), "sizes of the model's named dynamic dimensions, 'name=N' each (e.g. "
                                    "'batch=1')", read_only=True)
    state: Tuple[str, ...] = setting((), "state pairs '<input>:<output>' the model takes and returns (empty: "
                                     "recognise <b>_in:<b>_out and <n>:<n>_out, e.g. Isaac Lab's h_in:h_out, "
                                     "c_in:c_out)", read_only=True)
    state_binding: str = setting("auto", "state outputs: auto (written in place where ONNX Runtime's optimised "
                                 "graph allows it, else one copy) or copy", choices=("auto", "copy"), read_only=True)
    observation: str = setting("", "the model input fed the observation ('': the one input left, or 'obs')",
                               read_only=True)
    action: str = setting("", "the model output holding the action ('': the one output left, or 'actions')",
                          read_only=True)
    episode_start: str = setting("", "a model input set to 1 on an episode's first step and 0 after ('': an input "
                                 "named episode_starts, episode_start or is_init, if any)", read_only=True)
    observations: Tuple[str, ...] = setting((), "observation terms in the order the policy was trained with, "
                                            "'<function>:<port>[.<field>] [scale=S] [offset=O] [clip=LO,HI]' each "
                                            "(empty: every port, in ports.names order; docs/onnx.md lists the "
                                            "functions)", read_only=True)
    default_joint_pos: Tuple[float, ...] = setting((), "default joint positions in the policy's joint order "
                                                   "(joint_pos_rel terms, use_default_offset)", read_only=True)
    action_scale: Tuple[float, ...] = setting((1.0,), "joint target = raw action * action_scale + offset: one value "
                                              "or one per action", read_only=True)
    action_offset: Tuple[float, ...] = setting((0.0,), "offset added to the scaled action: one value or one per action",
                                               read_only=True)
    use_default_offset: bool = setting(False, "add default_joint_pos to the offset (Isaac Lab's JointPositionAction "
                                       "use_default_offset)", read_only=True)
    action_clip: Tuple[float, ...] = setting((), "[low, high] the joint targets are clamped to (empty: none)",
                                             read_only=True)

    def check(self) -> None:
        if not self.model:
            raise ConfigError(f"{self.SECTION}.model: must name an .onnx file")
        self.dimension_sizes()
        if self.action_clip and (len(self.action_clip) != 2 or self.action_clip[0] > self.action_clip[1]):
            raise ConfigError(f"{self.SECTION}.action_clip = {list(self.action_clip)}: must be [low, high], "
                              "low <= high")
        for name in ("action_scale", "action_offset"):
            if not getattr(self, name):
                raise ConfigError(f"{self.SECTION}.{name}: give one value, or one per action")

    def dimension_sizes(self) -> Tuple[Tuple[str, int], ...]:
        out = []
        for entry in self.dims:
            match = re.fullmatch(r"\s*([^=\s]+)\s*=\s*([0-9]+)\s*", entry)
            if match is None or int(match.group(2)) < 1:
                raise ConfigError(f"{self.SECTION}.dims entry {entry!r}: expected 'name=N' with N >= 1")
            out.append((match.group(1), int(match.group(2))))
        return tuple(out)

    def session(self) -> SessionSettings:
        return SessionSettings(self.execution_provider, self.optimization, self.threads, self.cuda_graph,
                               self.dimension_sizes())

    def action_map(self, size: int) -> ActionMap:
        def per_action(name: str, values: Tuple[float, ...]) -> Tuple[float, ...]:
            if len(values) == 1:
                return values * size
            if len(values) != size:
                raise ConfigError(f"{self.SECTION}.{name}: {len(values)} values for {size} actions (give one, or one "
                                  "per action)")
            return values
        offset = per_action("action_offset", self.action_offset)
        if self.use_default_offset:
            offset = tuple(o + d for o, d in zip(offset, per_action("default_joint_pos", self.default_joint_pos),
                                                 strict=True))
        clip = (self.action_clip[0], self.action_clip[1]) if self.action_clip else (-math.inf, math.inf)
        return ActionMap(per_action("action_scale", self.action_scale), offset, clip)


def build(context: BuildContext) -> OnnxPolicy:
    """The policy for the configured ports (checks in the module docstring's order)."""
    settings = context.settings
    assert isinstance(settings, OnnxConfig)
    where = f"policy.onnx.model = {settings.model!r}"
    if context.weights is not None:
        raise ConfigError(f"policy.weights names {context.weights}: an ONNX model carries its own weights; set "
                          "policy.weights: '' with policy.kind: onnx")
    session = settings.session()
    if settings.execution_provider == "cuda":
        import onnxruntime
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ConfigError(f"policy.onnx.execution_provider is 'cuda' but this onnxruntime "
                              f"({onnxruntime.__version__}) "
                              f"has only {onnxruntime.get_available_providers()}: install onnxruntime-gpu of the same "
                              "version, or use execution_provider: cpu")
    model = read_model(Path(settings.model), dict(session.dims), where)
    roles = resolve_roles(model, settings.state, settings.observation, settings.action, settings.episode_start, where)
    plan = ObservationPlan.parse(settings.observations, context.ports, settings.default_joint_pos,
                                 roles.action.numel, "policy.onnx.observations")
    roles = decide_in_place(model, roles, session, settings.state_binding)
    return OnnxPolicy(model, roles, plan, settings.action_map(roles.action.numel), context.inputs, session)


POLICY_KIND = PolicyKind("onnx", OnnxConfig, build,
                         "an ONNX model (Isaac Lab / rsl_rl, sb3-contrib exports) run by ONNX Runtime over the arena, "
                         "its observation assembled from ports as Isaac Lab's terms are")
