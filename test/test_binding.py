"""The binding vocabulary (capsule_ros.policies.binding): one checker, rules as data.

The kinds' own messages are pinned by their tests (test_onnx, test_exported,
test_lerobot_kinds, test_lerobot_parity, test_lerobot_guide); here the checker's
mechanics and its default wording, with a vision-language-action table of the shape the
coming VLA kinds need (two cameras, joint state, task tokens fed by a std_msgs/String
port, an action chunk) written as data only.
"""
from __future__ import annotations

import pytest
import torch

from capsule_ros.errors import ConfigError
from capsule_ros.policies.binding import (
    IMAGE_MESSAGES,
    RGB_IMAGE,
    TEXT_MESSAGES,
    TOKENS,
    VECTOR,
    VECTOR_MESSAGES,
    BindingRules,
    Count,
    PairRule,
    Port,
    Report,
    Requirement,
    Role,
    RoleRule,
    Side,
    Tensor,
    bind,
    examine,
    require,
    unmet,
)
from capsule_ros.runtime.arena import BufferKind, BufferSpec

IMAGE, JOINTS, TEXT = "sensor_msgs/msg/Image", "sensor_msgs/msg/JointState", "std_msgs/msg/String"

VLA_RULES = BindingRules(roles=(
    RoleRule(Role.CAMERA, labels=("VISUAL",), feed=RGB_IMAGE, messages=IMAGE_MESSAGES, noun="camera feature"),
    RoleRule(Role.ROBOT_STATE, labels=("STATE",), names=("observation.state",), feed=VECTOR, messages=VECTOR_MESSAGES),
    RoleRule(Role.TASK, labels=("TASK",), count=Count.ONE, feed=TOKENS, messages=TEXT_MESSAGES,
             dtypes=(torch.int64,), allowed="int64 token ids"),
    RoleRule(Role.ACTION_CHUNK, Side.OUTPUT, Count.ONE, labels=("ACTION",), dtypes=(torch.float32,),
             allowed="float32"),
), reserved_ports=("action", "chunk"))

TENSORS = [Tensor("observation.images.top", (3, 32, 40), torch.float32, "VISUAL"),
           Tensor("observation.state", (6,), torch.float32, "STATE"),
           Tensor("observation.images.wrist", (3, 24, 24), torch.float32, "VISUAL"),
           Tensor("task", (48,), torch.int64, "TASK")]
CHUNK = Tensor("action", (50, 6), torch.float32, "ACTION")


def _port(name, shape, dtype, message):
    return Port(BufferSpec(name, shape, dtype, BufferKind.INPUT), message)


def vla_ports(**changes):
    ports = {"top": _port("top", (32, 40, 3), torch.uint8, IMAGE),
             "joints": _port("joints", (6,), torch.float32, JOINTS),
             "wrist": _port("wrist", (24, 24, 3), torch.uint8, IMAGE),
             "instruction": _port("instruction", (48,), torch.int64, TEXT)}
    ports.update(changes)
    return {name: port for name, port in ports.items() if port is not None}


FEEDS = {"observation.images.top": "top", "observation.state": "joints", "observation.images.wrist": "wrist",
         "task": "instruction"}


def vla_bind(ports=None, feeds=None, tensors=None, **kwargs):
    return bind(VLA_RULES, inputs=tensors or TENSORS, outputs=[CHUNK], ports=vla_ports() if ports is None else ports,
                feeds=FEEDS if feeds is None else feeds, where="smolvla/config.json",
                section="policy.lerobot_smolvla", **kwargs)


def test_a_vla_table_binds_cameras_joint_state_task_tokens_and_the_action_chunk():
    table = vla_bind()
    assert [(b.role, b.tensor.name, b.port.name if b.port else None) for b in table.bindings] == [
        (Role.CAMERA, "observation.images.top", "top"), (Role.ROBOT_STATE, "observation.state", "joints"),
        (Role.CAMERA, "observation.images.wrist", "wrist"), (Role.TASK, "task", "instruction"),
        (Role.ACTION_CHUNK, "action", None)]
    assert [b.tensor.name for b in table.of(Role.CAMERA)] == ["observation.images.top", "observation.images.wrist"]
    assert table.one(Role.TASK).port == BufferSpec("instruction", (48,), torch.int64, BufferKind.INPUT)
    assert [b.tensor.name for b in table.fed()] == ["observation.images.top", "observation.state",
                                                    "observation.images.wrist", "task"]
    assert table.describe()[3] == {"role": "task", "tensor": "task int64[48]", "port": "instruction"}


@pytest.mark.parametrize("ports, feeds, expect", [
    ({"instruction": _port("instruction", (48,), torch.int64, IMAGE)}, None,
     "port 'instruction' (sensor_msgs/msg/Image) cannot feed 'task' (TASK): it needs a std_msgs/msg/String port"),
    ({"top": _port("top", (32, 40, 3), torch.uint8, TEXT)}, None,
     "port 'top' (std_msgs/msg/String) cannot feed 'observation.images.top' (VISUAL): it needs a "
     "sensor_msgs/msg/Image port"),
    ({"instruction": _port("instruction", (32,), torch.int64, TEXT)}, None,
     "port 'instruction' cannot feed 'task': it is int64 [32], smolvla/config.json needs token ids [L] int64 [48]"),
    ({"joints": _port("joints", (7,), torch.float32, JOINTS)}, None,
     "port 'joints' cannot feed 'observation.state': it is float32 [7], smolvla/config.json needs a vector "
     "float32 [6]"),
    ({"spare": _port("spare", (3,), torch.float32, JOINTS)}, None,
     "port 'spare' feeds nothing of smolvla/config.json: map it in policy.lerobot_smolvla.features or remove it "
     "from ports.names"),
    ({}, {**FEEDS, "task": "prompt"}, "policy.lerobot_smolvla.features maps 'task' to port 'prompt', which is not in "
                                      "ports.names ['top', 'joints', 'wrist', 'instruction']"),
    ({"instruction": None}, {k: v for k, v in FEEDS.items() if k != "task"},
     "'task' of smolvla/config.json has no port in policy.lerobot_smolvla.features: map it to the text port that "
     "feeds it"),
    ({}, {**FEEDS, "observation.images.side": "top"},
     "policy.lerobot_smolvla.features entry 'observation.images.side' is not an input of smolvla/config.json"),
    ({"chunk": _port("chunk", (6,), torch.float32, JOINTS), "joints": None}, {**FEEDS, "observation.state": "chunk"},
     "port name 'chunk' (feeding 'observation.state') is a buffer of the policy itself; rename the port"),
    ({"wrist": None}, {**FEEDS, "observation.images.wrist": "top"},
     "port 'top' cannot feed 'observation.images.wrist': it is uint8 [32, 40, 3]"),
    ({"wrist": None}, {**FEEDS, "observation.images.top": "joints", "observation.images.wrist": "top"},
     "port 'joints' (sensor_msgs/msg/JointState) cannot feed 'observation.images.top' (VISUAL)"),
    ({"wrist": _port("wrist", (32, 40, 3), torch.uint8, IMAGE)}, {**FEEDS, "observation.images.wrist": "top"},
     "port 'wrist' feeds nothing of smolvla/config.json"),
])
def test_a_vla_binding_error_names_the_port_key_and_what_is_allowed(ports, feeds, expect):
    with pytest.raises(ConfigError) as err:
        vla_bind(ports=vla_ports(**ports), feeds=feeds)
    assert str(err.value).startswith(expect), str(err.value)


def test_tensors_the_table_does_not_take_are_refused_by_label_and_name():
    odd = [*TENSORS, Tensor("observation.joints", (4,), torch.float32, "STATE")]
    with pytest.raises(ConfigError, match=r"input 'observation.joints' \(STATE\) is read only as "
                                          r"'observation.state'; rename it or drop it"):
        vla_bind(tensors=odd, feeds={**FEEDS, "observation.joints": "joints"})
    audio = [*TENSORS, Tensor("observation.audio", (16,), torch.float32, "AUDIO")]
    with pytest.raises(ConfigError, match=r"input 'observation.audio' has type 'AUDIO'; supported: VISUAL, STATE, "
                                          r"TASK, ACTION"):
        vla_bind(tensors=audio)
    with pytest.raises(ConfigError, match=r"^smolvla/config.json: the policy has no task \(exactly one\)$"):
        vla_bind(tensors=TENSORS[:3], feeds={k: v for k, v in FEEDS.items() if k != "task"},
                 ports=vla_ports(instruction=None))
    two = [*TENSORS, Tensor("task2", (48,), torch.int64, "TASK")]
    with pytest.raises(ConfigError, match=r"^smolvla/config.json: \['task', 'task2'\] are each a task; the policy "
                                          r"takes exactly one$"):
        vla_bind(tensors=two, feeds={**FEEDS, "task2": "instruction2"},
                 ports=vla_ports(instruction2=_port("instruction2", (48,), torch.int64, TEXT)))


def test_resizable_feeds_take_another_size_only_when_asked():
    ports = vla_ports(top=_port("top", (480, 640, 3), torch.uint8, IMAGE))
    with pytest.raises(ConfigError, match=r"it is uint8 \[480, 640, 3\], .* needs an RGB camera image \[H, W, 3\] "
                                          r"uint8 \[32, 40\, 3]"):
        vla_bind(ports=ports)
    assert vla_bind(ports=ports, resize=True).one(Role.CAMERA).port.shape == (480, 640, 3)
    gray = vla_ports(top=_port("top", (480, 640, 1), torch.uint8, IMAGE))
    with pytest.raises(ConfigError, match="it is uint8 \\[480, 640, 1\\]"):
        vla_bind(ports=gray, resize=True)                   # another layout is never resized


CHOICE_RULES = BindingRules(
    pairs=PairRule("policy.k.state", patterns=(("{}_in", "{}_out"),)),
    roles=(RoleRule(Role.OBSERVATION, Side.INPUT, Count.ONE, setting="policy.k.observation", usual=("obs",),
                    dtypes=(torch.float32,), allowed="float32", noun="observation input"),
           RoleRule(Role.ACTION, Side.OUTPUT, Count.ONE, setting="policy.k.action", usual=("actions",)),
           RoleRule(Role.EPISODE_START, Side.INPUT, Count.OPTIONAL, setting="policy.k.episode_start",
                    usual=("is_init",)),
           RoleRule(Role.EXTRA_OUTPUT, Side.OUTPUT)))


def _t(name, dtype=torch.float32, shape=(1, 4)):
    return Tensor(name, shape, dtype)


def test_choice_rules_take_the_setting_then_the_only_one_then_a_usual_name():
    inputs = [_t("c_in"), _t("x"), _t("h_in"), _t("is_init", torch.int64)]
    outputs = [_t("a"), _t("h_out"), _t("c_out")]
    table = bind(CHOICE_RULES, inputs=inputs, outputs=outputs, where="m")
    assert [(b.tensor.name, b.partner.name) for b in table.of(Role.STATE)] == [("c_in", "c_out"), ("h_in", "h_out")]
    assert table.one(Role.OBSERVATION).tensor.name == "x" and table.one(Role.EPISODE_START).tensor.name == "is_init"
    assert table.one(Role.ACTION).tensor.name == "a" and table.of(Role.EXTRA_OUTPUT) == ()
    with pytest.raises(ConfigError, match=r"m: cannot tell which output is the action: \['a', 'value'\] are left "
                                          r"after the state pairs; set policy.k.action"):
        bind(CHOICE_RULES, inputs=inputs, outputs=[*outputs, _t("value")], where="m")
    table = bind(CHOICE_RULES, inputs=inputs, outputs=[*outputs, _t("value"), _t("actions")], where="m")
    assert table.one(Role.ACTION).tensor.name == "actions"                         # the usual name among several
    assert [b.tensor.name for b in table.of(Role.EXTRA_OUTPUT)] == ["a", "value"]
    table = bind(CHOICE_RULES, inputs=inputs, outputs=[*outputs, _t("value")], where="m",
                 chosen={"policy.k.action": "value"}, pairs=["h_in:h_out", "c_in:c_out"])
    assert [b.tensor.name for b in table.of(Role.STATE)] == ["h_in", "c_in"]    # the setting's order
    assert table.one(Role.ACTION).tensor.name == "value" and table.sources(Role.EXTRA_OUTPUT) == (None,)
    with pytest.raises(ConfigError, match=r"m: policy.k.observation = 'h_in' is not a free input of the model"):
        bind(CHOICE_RULES, inputs=inputs, outputs=outputs, where="m", chosen={"policy.k.observation": "h_in"})
    with pytest.raises(ConfigError, match=r"m: the observation input x float64\[1, 4\] must be float32"):
        bind(CHOICE_RULES, inputs=[_t("x", torch.float64)], outputs=[_t("a")], where="m")
    with pytest.raises(ConfigError, match=r"m: the inputs \['y'\] have no role; capsule_ros cannot feed them"):
        bind(CHOICE_RULES, inputs=[_t("obs"), _t("y")], outputs=[_t("a")], where="m")
    with pytest.raises(ConfigError, match=r"m: policy.k.state pairs 'h_in' with 'h_next', but the model has no "
                                          r"output 'h_next'"):
        bind(CHOICE_RULES, inputs=inputs, outputs=outputs, where="m", pairs=["h_in:h_next"])


def test_report_all_joins_every_problem_and_examine_returns_them():
    rules = BindingRules(roles=(RoleRule(Role.OBSERVATION, labels=("input",), count=Count.SOME, kinds=("input",)),),
                         reserved=("step",), unique=True, report=Report.ALL)
    tensors = [Tensor("step", (1,), torch.float32, "input", "meta"), Tensor("x", (1,), torch.float32, "input", "input"),
               Tensor("x", (2,), torch.float32, "input", "input")]
    table, problems = examine(rules, inputs=tensors, where="w")
    assert problems == ["w: input 'step' has kind meta (must be input)", "w: name 'x' is used twice",
                        "w: name 'step' is a buffer the runtime writes (['step'])"]
    assert len(table.of(Role.OBSERVATION)) == 3
    with pytest.raises(ConfigError) as err:
        bind(rules, inputs=tensors, where="w")
    assert str(err.value) == "w: " + "; ".join(problems)


def test_requirements_report_the_first_failure_or_every_one():
    rows = (Requirement(lambda c: c["n"] >= 1, lambda c: f"n = {c['n']} must be >= 1"),
            Requirement(lambda c: c["m"] % c["n"] == 0, lambda c: f"m = {c['m']} is not a multiple of n"))
    require(rows, {"n": 2, "m": 4})
    with pytest.raises(ConfigError, match=r"^policy.k: n = 0 must be >= 1$"):
        require(rows, {"n": 0, "m": 4}, prefix="policy.k: ")          # the second row would divide by zero
    assert unmet(rows, {"n": 3, "m": 4}) == ["m = 4 is not a multiple of n"]
