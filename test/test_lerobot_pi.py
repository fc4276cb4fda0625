"""capsule_ros's π0 and π0.5 (``policy.kind: lerobot_pi0`` / ``lerobot_pi05``) against LeRobot 0.6.1's own actions.

The fixtures (``test/fixtures/lerobot/pi0``, ``pi05``, ``pi0_bf16``, made by
``tools/lerobot_fixtures/make_pi_fixtures.py``) hold scaled-down checkpoints LeRobot built and
saved, 3 episodes x 120 steps of camera frames, joint states and tasks that change
mid-chunk (an over-long one, an empty one, non-ASCII text), and LeRobot's actions: the
``select_action`` loop, and the fixed-delay ``predict_action_chunk`` loop for a few delays,
without and with real-time chunking guidance. Every step runs through ``PolicyRuntime`` on
the CPU as the node drives it, and every action must be the same bits. Then capsules at
every cursor, π0.5's prompt, what configure refuses (in one line), the fingerprint, the
host-sync-free plan, and the benchmark checkpoint writer. ROS-free; nothing here imports
LeRobot.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Dict

import numpy as np
import pytest
import torch
from pi_fixtures import NAMES, TASK_PORT, PiFixture, port_of
from safetensors.torch import load_file, save_file
from vla_fixtures import assert_same_actions, bits, chunked_runtime

from capsule_ros.benchmarks.lerobot_pi import (
    PALIGEMMA_3B,
    TINY,
    pi_config,
    tensor_specs,
    with_cameras,
    write_pi_checkpoint,
)
from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import read_checkpoint
from capsule_ros.policies.lerobot.pi.architecture import LEROBOT_VARIANTS, PALIGEMMA_VISION, read_architecture
from capsule_ros.policies.lerobot.pi.kind import Pi0Settings, build
from capsule_ros.policies.lerobot.pi.policy import PROMPT_BUFFER
from capsule_ros.policies.lerobot.pi.prompt import state_prompt
from capsule_ros.policies.registry import BuildContext
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import runtime_identity
from capsule_ros.runtime.engine import RuntimeConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Dict[str, PiFixture]:
    root = tmp_path_factory.mktemp("pi")
    return {name: PiFixture.load(name, root) for name in NAMES}


# --- LeRobot's actions, bit for bit -----------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_sync_actions_are_lerobots_select_action(fixtures, name):
    fx = fixtures[name]
    assert_same_actions(fx.rollout(fx.runtime("sync")), fx.outputs["action"], f"{name} select_action")
    assert np.ptp(fx.outputs["action"], axis=(0, 1)).min() > 0.1, "the fixture's actions should vary"


@pytest.mark.parametrize("name", NAMES)
def test_async_actions_are_lerobots_fixed_delay_loop_with_and_without_rtc(fixtures, name):
    """Every delay of the references, RTC off and guided, the refill on its worker thread."""
    fx = fixtures[name]
    for delay in fx.meta["delays"]:
        for rtc, key in ((RTCSettings(), f"action_d{delay}"), (fx.rtc_settings(), f"action_d{delay}_rtc")):
            runtime = fx.runtime("async", delay, rtc)
            try:
                assert_same_actions(fx.rollout(runtime), fx.references[key], f"{name} {key}")
            finally:
                runtime.close()


def test_guidance_changes_the_actions_but_not_an_episodes_first_chunk(fixtures):
    fx = fixtures["pi0"]
    plain, guided = fx.references["action_d4"], fx.references["action_d4_rtc"]
    assert np.abs(plain - guided).max() > 1e-2
    first = fx.meta["horizons"][fx.meta["delays"].index(4)] + 4          # rows of the first chunk executed
    assert np.array_equal(bits(plain[:, :first]), bits(guided[:, :first]))


def test_a_changed_task_changes_the_next_chunk_only(fixtures):
    """A task staged mid-chunk changes nothing until the chunk is used up (LeRobot tokenises
    at every step but reads the tokens only when its queue is empty)."""
    fx = fixtures["pi0"]
    runtime = fx.runtime("sync")

    def run(task_from_step_3: str) -> np.ndarray:
        runtime.reset(episode=1, seed=fx.seed(0))
        out = []
        for t in range(12):
            fx.stage(runtime, 0, t)
            if t >= 3:
                runtime.stage_text(TASK_PORT, task_from_step_3)
            runtime.load_inputs()
            runtime.step()
            out.append(runtime.read_step_outputs().action.copy())
        return np.stack(out)
    same, other = run(fx.task(0, 0)), run("close the drawer")
    assert np.array_equal(bits(same[:8]), bits(other[:8]))              # n_action_steps = 8: one chunk
    assert not np.array_equal(bits(same[8:]), bits(other[8:]))


def test_policy_task_default_without_a_task_port(fixtures):
    """Without a task port the task is policy.task (π0.5: its prompt too)."""
    fx = fixtures["pi05"]
    policy = build(fx.context(task=fx.task(0, 0), task_port=False))
    assert policy.text_inputs() == {}
    runtime = chunked_runtime(policy)
    runtime.reset(episode=1, seed=fx.seed(0))
    actions = []
    for t in range(29):                               # episode 0 keeps its first task up to step 28
        for key, value in fx.features.items():
            runtime.staging[port_of(key)][...] = value[0, t]
        runtime.load_inputs()
        runtime.step()
        actions.append(runtime.read_step_outputs().action.copy())
    assert_same_actions(np.stack(actions)[None], fx.outputs["action"][:1, :29], "policy.task")


def test_pi05_through_the_session_with_its_task_on_a_string_port_is_lerobots(fixtures):
    """The node's path: the task arrives as serialized std_msgs/msg/String messages (an
    over-long, an empty and a non-ASCII one in this episode), its text is kept beside its
    tokens, and π0.5's prompt is made from it and the staged state at the steps that plan.
    The staged rows (the input log's) then reproduce every action in another runtime with
    no tokenizer call: the prompt travels with the inputs."""
    from rclpy.serialization import serialize_message
    from std_msgs.msg import String

    from capsule_ros.serving.config import ServingConfig
    from capsule_ros.serving.factory import build_session
    fx = fixtures["pi05"]
    episode, actions, rows = 1, [], []
    session = build_session(ServingConfig.from_params(fx.serving_params(episode)))
    session.verbs.reset()
    for t in range(fx.steps):
        for key, value in fx.features.items():
            session.loop.write_input(port_of(key), value[episode, t])
        fed = session.loop.feed(TASK_PORT, bytes(serialize_message(String(data=fx.task(episode, t)))), stage_only=True)
        assert fed.accepted, fed.drop
        actions.append(session.loop.tick().values.copy())
        rows.append(session.parts.runtime.input_staging.clone())
    assert_same_actions(np.stack(actions)[None], fx.outputs["action"][episode:episode + 1], "pi05 session")
    replay = fx.runtime("sync")
    replay.reset(episode=episode + 1, seed=fx.seed(episode))
    replay.texts.clear()                            # nothing to tokenise from: the rows carry the prompt
    again = []
    for row in rows:
        replay.load_inputs(row)
        replay.step()
        again.append(replay.read_step_outputs().action.copy())
    assert_same_actions(np.stack(again)[None], np.stack(actions)[None], "pi05 from the logged rows")


# --- capsules ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name, mode, delay, guided", [("pi0", "sync", 0, False), ("pi05", "async", 3, True)])
def test_a_capsule_at_every_cursor_restores_byte_exactly_and_replays_bit_identically(fixtures, name, mode, delay,
                                                                                      guided, device):
    """The arena at every row of a chunk cycle (async: with and without a refill in flight)
    put back after other steps gives the same bytes and then the same actions: the chunk,
    cursor, pending request, task and prompt tokens and RNG counter are all in it. On CUDA
    every program is a captured graph (async: the refill too, on its own stream)."""
    fx = fixtures[name]
    runtime = fx.runtime(mode, delay, fx.rtc_settings() if guided else None, device=device)
    try:
        assert fx.check_capsules_at_every_cursor(runtime, name) == (mode == "async")
    finally:
        runtime.close()


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_graph_programs_equal_the_eager_cuda_plan(fixtures, name, mode, record_property):
    """Every program captured as a CUDA graph (async, RTC guided: the refill on its own
    stream; the two cameras' SigLIP towers side by side, on streams of their own) gives the
    eager CUDA plan's actions bit for bit, the eager plan embedding the cameras one after the
    other as LeRobot does. LeRobot's CPU actions are
    another device's kernels (cuDNN's TF32 convolution in SigLIP's patch embedding, other
    GEMMs, bfloat16 rounding): the largest difference is recorded, and bounded only
    against garbage."""
    fx = fixtures[name]
    delay = fx.meta["delays"][len(fx.meta["delays"]) // 2] if mode == "async" else 0
    rtc = fx.rtc_settings() if mode == "async" else None
    graphed = fx.runtime(mode, delay, rtc, device="cuda", cuda_graphs=True)
    eager = fx.runtime(mode, delay, rtc, device="cuda", cuda_graphs=False, worker="inline")
    eager.policy.side_by_side.enabled = False
    try:
        assert graphed.graphs.captured and set(graphed.graphs._graphs) == set(graphed.graphs.programs)
        got = {}
        for key, runtime in (("graph", graphed), ("eager", eager)):
            runtime.reset(episode=1, seed=fx.seed(0))
            got[key] = np.stack([fx.act(runtime, 0, t) for t in range(40)])
        assert_same_actions(got["graph"][None], got["eager"][None], f"{name} {mode} graphs against eager")
        reference = fx.outputs["action"] if mode == "sync" else fx.references[f"action_d{delay}_rtc"]
        diff = float(np.abs(got["graph"] - reference[0, :40]).max())
        record_property("max_abs_diff_to_lerobot_cpu", diff)
        print(f"{name} {mode}: CUDA graphs against LeRobot on the CPU, max abs diff {diff:.3g}")
        assert np.isfinite(got["graph"]).all() and diff < 1.0
    finally:
        graphed.close()
        eager.close()


# --- π0.5's prompt ----------------------------------------------------------------------------------

def test_the_pi05_prompt_is_lerobots(fixtures):
    """The bins (below -1, the edges, above 1), the cleaned task, and the staged tokens are
    the tokenizer's for that string."""
    state = np.array([-1.5, -1.0, -0.9921875, -0.99, 0.0, 0.5, 0.9921875, 1.0, 2.0], np.float32)
    assert state_prompt("  Pick_up\nthe cube\n", state) == \
        "Task: Pick up the cube, State: -1 0 1 1 128 192 255 255 255;\nAction: "
    assert state_prompt("", state[:1]) == "Task: , State: -1;\nAction: "
    fx = fixtures["pi05"]
    runtime = fx.runtime("sync")
    runtime.reset(episode=1, seed=fx.seed(0))
    fx.stage(runtime, 1, 50)
    runtime.load_inputs()                              # the episode's first step plans: the prompt is made
    policy = runtime.policy
    normalized = policy.host_state_norm(fx.inputs["observation.state"][1, 50])
    expected = policy.prompt_tokenizer.encode(state_prompt(fx.task(1, 50), normalized))
    assert np.array_equal(runtime.staging[PROMPT_BUFFER], expected)
    raw = policy.prompt_tokenizer.tokenizer([state_prompt(fx.task(1, 50), normalized)], max_length=200,
                                            truncation=True, padding="max_length", padding_side="right")
    assert expected.tolist() == [raw["input_ids"][0], raw["attention_mask"][0]]
    assert expected[1].all() or fx.task(1, 50) != fx.task(1, 0)  # the over-long task fills all 200 tokens


# --- what configure refuses, in one line --------------------------------------------------------------

def copy_fixture(fx: PiFixture, tmp_path: Path) -> PiFixture:
    checkpoint = tmp_path / fx.name / "pretrained_model"
    shutil.copytree(fx.checkpoint, checkpoint)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(fx.tokenizer, tokenizer)
    return dataclasses.replace(fx, checkpoint_dir=checkpoint, tokenizer=tokenizer)


def rewrite_weights(fx: PiFixture, change) -> None:
    path = fx.checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def rewrite_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def refusal(fx: PiFixture, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        build(fx.context(**kw))
    message = str(info.value)
    assert "\n" not in message, message
    return message


VLM_KEY = "model.paligemma_with_expert.paligemma.model.language_model.layers.1.mlp.up_proj.weight"
EXPERT_KEY = "model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.o_proj.weight"
EMBED_KEY = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


def _escape(key: str) -> str:
    return key.replace(".", r"\.")


@pytest.mark.parametrize("damage, expected", [
    (lambda t: t.pop(VLM_KEY), r"1 missing \(" + _escape(VLM_KEY)),
    (lambda t: t.update({"model.extra.weight": torch.zeros(3)}), r"1 unexpected \(model\.extra\.weight"),
    (lambda t: t.update({EXPERT_KEY: t[EXPERT_KEY][:, :-1].contiguous()}), r"1 mismatched \(" + _escape(EXPERT_KEY)),
    (lambda t: t.update({EXPERT_KEY: t[EXPERT_KEY].to(torch.float16)}), r"torch\.float16, model .* torch\.bfloat16"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_tensor(fixtures, tmp_path, damage, expected):
    fx = copy_fixture(fixtures["pi0_bf16"], tmp_path)
    rewrite_weights(fx, damage)
    message = refusal(fx)
    assert "model.safetensors does not fit the pi0 policy" in message
    assert re.search(expected, message), message


def test_missing_tokenizer_is_refused(fixtures, tmp_path):
    fx = copy_fixture(fixtures["pi0"], tmp_path)
    for path in fx.tokenizer.iterdir():
        path.unlink()
    assert "holds no tokenizer" in refusal(fx)


def test_a_vocabulary_that_does_not_fit_the_embedding_is_refused(fixtures, tmp_path):
    fx = copy_fixture(fixtures["pi05"], tmp_path)
    rewrite_weights(fx, lambda t: t.update({EMBED_KEY: t[EMBED_KEY][:100].contiguous()}))
    assert "tokens but the text embedding has 100 rows" in refusal(fx)


def test_the_tokenizer_is_never_downloaded(fixtures):
    fx = fixtures["pi0"]
    message = refusal(fx, settings=fx.settings(vlm_files=""))
    assert "google/paligemma-3b-pt-224" in message and "downloads nothing" in message


@pytest.mark.parametrize("change, expected", [
    (lambda c: c.update(use_relative_actions=True), "use_relative_actions = true is not supported"),
    (lambda c: c.update(dtype="float16"), "dtype = 'float16'"),
    (lambda c: c.update(image_resolution=[32, 48]), "needs a square"),
    (lambda c: c.update(type="pi05"), "type is 'pi05', expected 'pi0'"),
    (lambda c: c.update(n_action_steps=40), "n_action_steps = 40 > chunk_size = 16"),
])
def test_options_capsule_ros_does_not_reproduce_are_refused(fixtures, tmp_path, change, expected):
    fx = copy_fixture(fixtures["pi0"], tmp_path)
    rewrite_json(fx.checkpoint / "config.json", change)
    assert expected in refusal(fx)


def test_an_enabled_relative_action_step_or_a_foreign_step_is_refused(fixtures, tmp_path):
    fx = copy_fixture(fixtures["pi0"], tmp_path)
    path = fx.checkpoint / "policy_postprocessor.json"
    rewrite_json(path, lambda p: p["steps"][1]["config"].update(enabled=True))
    assert "absolute_actions_processor step is enabled" in refusal(fx)
    rewrite_json(path, lambda p: p["steps"][1]["config"].update(enabled=False))
    rewrite_json(path, lambda p: p["steps"].insert(1, {"registry_name": "clip_processor", "config": {}}))
    assert "processor step 'clip_processor' is not supported" in refusal(fx)


def test_guided_rtc_needs_async(fixtures):
    fx = fixtures["pi0"]
    with pytest.raises(ConfigError, match="needs control.chunking async"):
        fx.runtime("sync", rtc=fx.rtc_settings())


def test_the_fingerprint_covers_what_changes_the_numbers(fixtures):
    fx = fixtures["pi0_bf16"]
    plain = runtime_identity(fx.policy(), RuntimeConfig()).fingerprint
    assert runtime_identity(fx.policy(), RuntimeConfig()).fingerprint == plain
    guided = runtime_identity(fx.policy(fx.rtc_settings()), RuntimeConfig()).fingerprint
    other = runtime_identity(fx.policy(RTCSettings("guided", 3.0, "ONES", 5)), RuntimeConfig()).fingerprint
    assert len({plain, guided, other}) == 3
    architecture = fx.policy().architecture()
    assert architecture["denoise_steps"] == 10 and architecture["task"]["tokenizer"]["max_length"] == 48
    assert architecture["config"]["dtype"] == "bfloat16" and "vision_tower" in architecture["pi"]["float32_params"]
    assert architecture["pi"]["transformers"] and architecture["pi"]["tokenizer_files"]["tokenizer.json"]


# --- capturability ------------------------------------------------------------------------------------

SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero")


def test_a_refill_and_a_guided_request_never_need_a_host_sync(fixtures):
    """A CPU proxy for CUDA-graph capture: across the episode's first plan, consume steps and
    a guided request (planned inline), no op reads a tensor's value on the host."""
    from torch.utils._python_dispatch import TorchDispatchMode
    calls = []

    class Detector(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in SYNCING:
                calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    fx = fixtures["pi05"]
    runtime = fx.runtime("async", 3, fx.rtc_settings(), worker="inline")
    runtime.reset(episode=1, seed=fx.seed(0))
    for t in range(runtime.mode.schedule.end + 2):
        fx.stage(runtime, 0, t)
        runtime.load_inputs()                      # the host's prompt work is outside the detector
        with Detector():
            runtime.step()
    assert runtime.mode.counters.refills >= 2 and not calls, calls


# --- the benchmark checkpoints -------------------------------------------------------------------------

def test_the_benchmark_writer_makes_a_checkpoint_that_serves(tmp_path):
    spec = with_cameras(TINY, 2)
    checkpoint, tokenizer = write_pi_checkpoint(tmp_path, spec)
    assert read_architecture(read_checkpoint(checkpoint)) == spec.architecture()
    ports = ["observation.state:joints", "observation.images.camera0:camera0", "observation.images.camera1:camera1",
             f"task:{TASK_PORT}"]
    inputs = (BufferSpec("joints", (7,), torch.float32, BufferKind.INPUT),
              BufferSpec("camera0", (48, 64, 3), torch.uint8, BufferKind.INPUT),
              BufferSpec("camera1", (48, 64, 3), torch.uint8, BufferKind.INPUT),
              BufferSpec(TASK_PORT, (2, 48), torch.int64, BufferKind.INPUT))
    types = {"joints": "sensor_msgs/msg/JointState", "camera0": "sensor_msgs/msg/Image",
             "camera1": "sensor_msgs/msg/Image", TASK_PORT: "std_msgs/msg/String"}
    context = BuildContext(settings=Pi0Settings(pretrained_model=str(checkpoint), vlm_files=str(tokenizer),
                                                features=tuple(ports)),
                           inputs=inputs, ports={k: SimpleNamespace(type=v) for k, v in types.items()}, weights=None,
                           seed=0, device=torch.device("cpu"), task="pick up the cube")
    runtime = chunked_runtime(build(context))
    runtime.staging["camera0"][...] = 128
    runtime.load_inputs()
    runtime.step()
    assert np.isfinite(runtime.read_step_outputs().action).all()


def test_the_paligemma_3b_benchmark_checkpoint_has_the_real_dimensions(tmp_path):
    """π0 at PaliGemma-3B's size (nothing allocated: the model is built on the meta device):
    3.24 billion parameters besides the two LM heads, LeRobot's dtype map at bfloat16."""
    specs = tensor_specs(PALIGEMMA_3B)
    count = sum(int(np.prod(shape)) for name, (shape, _) in specs.items() if "lm_head" not in name)
    assert 3.2e9 < count < 3.3e9, count
    assert specs[EMBED_KEY] == ((257152, 2048), torch.bfloat16)
    vision = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    assert specs[vision + "embeddings.patch_embedding.weight"] == ((1152, 3, 14, 14), torch.float32)
    assert specs[vision + "encoder.layers.26.mlp.fc1.weight"] == ((4304, 1152), torch.float32)
    assert specs[EXPERT_KEY] == ((1024, 2048), torch.bfloat16)
    directory = tmp_path / "pretrained_model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(pi_config(with_cameras(PALIGEMMA_3B, 3))))
    save_file({}, str(directory / "model.safetensors"))
    arch = read_architecture(read_checkpoint(directory))
    assert (arch.vlm, arch.expert, arch.vision) == (LEROBOT_VARIANTS["gemma_2b"], LEROBOT_VARIANTS["gemma_300m"],
                                                    PALIGEMMA_VISION)
    assert arch == PALIGEMMA_3B.architecture()
