"""Make the vision-language-action parity fixtures under test/fixtures/lerobot/<name>/ (see README.md).

Run in LeRobot 0.6.1's environment (tools/lerobot_bench/.venv, Python 3.12, with the smolvla
extra), from the repository root:

    PYTHONPATH=. tools/lerobot_bench/.venv/bin/python tools/lerobot_fixtures/make_vla_fixtures.py [NAME ...]

For each fixture, offline (nothing comes from a model hub):

1. Stage a tiny VLM the way a hub download would lay it out, in ``vlm/``: a SmolVLM config
   (``config.json``: scaled-down vision, connector and text dimensions), a byte-level BPE
   tokenizer trained here with the ``tokenizers`` library (with SmolVLM's special tokens and
   a begin-of-sequence token added to every prompt) and the processor files
   ``AutoProcessor`` reads.
2. Build ``SmolVLAPolicy`` from a ``SmolVLAConfig`` whose ``vlm_model_name`` is that
   directory (``load_vlm_weights: false``: the VLM is built from its config, as LeRobot does
   for a SmolVLA checkpoint), overwrite its random weights with the low-entropy pattern of
   ``make_fixtures.pattern_weights_`` (so the checkpoint compresses to kilobytes), and save
   it with LeRobot's ``save_pretrained`` plus its pre/post-processors with non-trivial
   normalisation statistics. ``vlm_model_name`` and the tokenizer step's ``tokenizer_name``
   are then set to a hub-style id that exists nowhere (``capsule-ros-fixtures/<name>-vlm``),
   as a real checkpoint names ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``: whoever loads
   it must say where the VLM files are (LeRobot: a config and processor override;
   capsule_ros: ``policy.lerobot_smolvla.vlm_files``).
3. Load it back as a LeRobot user would offline (``from_pretrained`` with that override,
   ``make_pre_post_processors(pretrained_path=...)``) and record LeRobot's own actions over
   3 episodes with ``reset()`` between them and task instructions that change mid-episode
   (an over-long one, an empty one, multi-byte UTF-8, one that already ends in a newline):

   - ``outputs.npz``: ``action`` [E, S, A] from ``predict_action`` (preprocessor,
     ``select_action``, postprocessor), the synchronous loop;
   - ``async.npz``: ``action_d<d>`` and ``action_d<d>_rtc`` [E, S, A] from the fixed-delay loop
     of ``predict_action_chunk`` (capsule_ros's ``control.chunking: async``), without and
     with real-time chunking guidance, for a few delays d (``delays``, ``horizons``).

The flow-matching noise comes from capsule_ros's counter-based RNG: LeRobot's
``sample_noise`` is replaced by ``counter_normal((seed, step), (chunk_size, max_action_dim))``
at the step that predicts, which is what capsule_ros draws there.

The fixed-delay loop (d >= 1, L = chunk_size rows per chunk, e = min(n_action_steps, L - d)
rows executed per chunk, end E = e + d):

- the first step of an episode predicts from its own observation and executes row 0;
- the step that executes row e of the current chunk also predicts the next chunk from its own
  observation (the request), which takes over d steps later at its row d;
- with RTC (``RTCConfig(enabled=True, execution_horizon=H, ...)`` and ``init_rtc_processor``)
  the request passes ``inference_delay=d`` and ``prev_chunk_left_over``: the rows of the
  current chunk not executed before the request step (rows e .. L - 1, in the model's
  normalised action space), padded or truncated to H rows by LeRobot's own
  ``lerobot.rollout.inference.rtc._normalize_prev_actions_length``, as its RTC engine does;
  the first chunk of an episode has none. RTC runs outside ``torch.inference_mode`` (its
  guidance calls autograd), as LeRobot's engine runs it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from capsule_ros.runtime import numerics

LEVEL = numerics.pin(os.environ.get("CAPSULE_ROS_NUMERICS", numerics.PORTABLE), cpu_threads=1)  # before torch runs
os.environ["HF_HUB_OFFLINE"] = "1"

import lerobot  # noqa: E402
import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lerobot.common.control_utils import predict_action  # noqa: E402
from lerobot.configs import RTCAttentionSchedule  # noqa: E402
from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.factory import make_pre_post_processors  # noqa: E402
from lerobot.policies.rtc.configuration_rtc import RTCConfig  # noqa: E402
from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig  # noqa: E402
from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: E402
from lerobot.policies.utils import prepare_observation_for_inference  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMProcessor  # noqa: E402
from transformers.models.smolvlm.image_processing_smolvlm import SmolVLMImageProcessor  # noqa: E402
from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor  # noqa: E402

from capsule_ros.runtime.rng import counter_normal  # noqa: E402
from tools.lerobot_fixtures.make_fixtures import (  # noqa: E402
    OUT,
    camera_frames,
    pattern_weights_,
    random_walk,
    tar_xz_tree,
)

EPISODES, STEPS = 3, 40
HUB_ID = "capsule-ros-fixtures/{name}-vlm"          # a hub-style VLM id that exists nowhere
TOKENIZER_STEP = "tokenizer_processor"

# The instructions an episode is given, and when each starts (episode -> [(step, task index)]).
TASKS = (
    "pick up the red cube",
    "open the drawer and put the cube inside\n",                            # ends in a newline already
    "",                                                                     # empty: LeRobot tokenises "\n"
    "stack the green block on the blue block, then push the red button twice and wait until the arm has "
    "stopped moving completely before you open the gripper again",         # longer than the token length
    "pick up the café cup 🙂 gently",                                       # multi-byte UTF-8
)
SCHEDULE = {0: [(0, 0), (17, 1)], 1: [(0, 3), (12, 2), (26, 4)], 2: [(0, 4), (9, 0), (31, 1)]}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
                  "<global-img>", "<end_of_utterance>"]
EXTRA_SPECIAL = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                 "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
CORPUS = [t for t in TASKS if t] + ["place the bowl on the plate", "move the arm to the left", "close the drawer",
                                    "grasp the handle and pull", "put the spoon next to the cup"]


@dataclass
class VLMSpec:
    """The staged VLM: vision tower, connector and text model dimensions, and its dtype."""

    text_hidden: int = 64
    text_layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    text_intermediate: int = 128
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 64
    image_size: int = 48
    patch_size: int = 8
    scale_factor: int = 2
    vocab_size: int = 400                   # BPE merges trained up to this; the embedding has headroom
    embedding_headroom: int = 16
    dtype: Optional[str] = None             # "bfloat16": the text model's dtype, as in SmolVLM2's config.json


@dataclass
class VLAFixture:
    """One SmolVLA checkpoint and its rollouts."""

    name: str
    seed: int
    vlm: VLMSpec
    inputs: Dict[str, tuple]                 # feature -> ("walk", n) or ("camera", h, w)
    action_dim: int
    options: Dict[str, object]               # SmolVLAConfig fields
    stats: Dict[str, Dict[str, np.ndarray]]
    rtc: List[dict] = field(default_factory=list)   # RTC settings to record (besides "off")


def _vec(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


FIXTURES = (
    VLAFixture(
        name="smolvla_two_cams", seed=21, vlm=VLMSpec(),
        inputs={"observation.state": ("walk", 6), "observation.images.front": ("camera", 48, 64),
                "observation.images.wrist": ("camera", 40, 40)},
        action_dim=5,
        options=dict(chunk_size=10, n_action_steps=5, num_vlm_layers=4, resize_imgs_with_padding=(48, 48),
                     tokenizer_max_length=16, pad_language_to="longest", num_steps=10),
        stats={"observation.state": {"mean": _vec([0.1, -0.2, 0.0, 0.3, -0.1, 0.05]),
                                     "std": _vec([0.8, 1.2, 0.5, 1.0, 0.9, 1.5])},
               "action": {"mean": _vec([0.2, -0.1, 0.0, 0.5, -0.3]), "std": _vec([0.5, 1.0, 2.0, 0.7, 1.3])}},
        # the leftover as it is (0: its own length), and truncated to 3 rows
        rtc=[dict(prefix_attention_schedule="LINEAR", max_guidance_weight=10.0, execution_horizon=0),
             dict(prefix_attention_schedule="ONES", max_guidance_weight=2.0, execution_horizon=3)]),
    VLAFixture(
        name="smolvla_bf16_one_cam", seed=22, vlm=VLMSpec(text_layers=4, dtype="bfloat16", image_size=32),
        inputs={"observation.state": ("walk", 4), "observation.images.top": ("camera", 48, 64)},
        action_dim=4,
        options=dict(chunk_size=8, n_action_steps=4, num_vlm_layers=4, num_expert_layers=2, self_attn_every_n_layers=-1,
                     resize_imgs_with_padding=(32, 32), tokenizer_max_length=12, pad_language_to="max_length",
                     add_image_special_tokens=True, prefix_length=40, num_steps=5,
                     normalization_mapping={"VISUAL": "IDENTITY", "STATE": "MIN_MAX", "ACTION": "MEAN_STD"}),
        stats={"observation.state": {"min": _vec([-1.5, -1.0, -2.0, -1.2]), "max": _vec([1.5, 1.2, 2.0, 0.8])},
               "action": {"mean": _vec([0.3, -0.2, 0.1, 0.0]), "std": _vec([0.9, 1.4, 0.6, 1.1])}},
        # the leftover (L - e = 4 rows) zero-padded to 6, as LeRobot's engine pads it
        rtc=[dict(prefix_attention_schedule="EXP", max_guidance_weight=5.0, execution_horizon=6)]),
)


def lerobot_function(module_file: str, name: str):
    """A module-level function of LeRobot's source, taken from its file without importing the
    module: ``lerobot.rollout`` imports ``datasets`` (LeRobot's dataset extra), which this
    environment does not need, yet the RTC engine's prefix padding lives there."""
    import ast
    import importlib.util
    spec = importlib.util.find_spec("lerobot")
    assert spec is not None and spec.submodule_search_locations
    source = (Path(list(spec.submodule_search_locations)[0]) / module_file).read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), module_file, "exec"), namespace)
    return namespace[name]


# LeRobot's RTC engine pads or truncates the leftover to the execution horizon with this
_normalize_prev_actions_length = lerobot_function("rollout/inference/rtc.py", "_normalize_prev_actions_length")


# --- the staged VLM ------------------------------------------------------------------------------

def train_tokenizer(spec: VLMSpec) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the fixture's instructions (any UTF-8 text encodes), with
    SmolVLM's special tokens and a begin-of-sequence token prepended to every prompt."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = "<|im_start|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   extra_special_tokens=dict(EXTRA_SPECIAL))


def stage_vlm(spec: VLMSpec, directory: Path) -> None:
    """config.json, the tokenizer and the processor files of a tiny SmolVLM in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec)
    text = dict(model_type="llama", hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
                num_hidden_layers=spec.text_layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                vocab_size=len(tokenizer) + spec.embedding_headroom, rms_norm_eps=1e-5, rope_theta=100000.0,
                max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                  num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                  image_size=spec.image_size, patch_size=spec.patch_size)
    config = SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=spec.scale_factor,
                           image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                           pad_token_id=tokenizer.pad_token_id)
    config.save_pretrained(directory)
    if spec.dtype is not None:
        # as a config.json written by transformers 4 names it: at the top and for the text model. LeRobot
        # then builds the text model and the expert (a copy of the text config) in that dtype, the vision
        # tower and the connector in float32 (with the dtype in the vision config too, LeRobot 0.6.1 fails:
        # a bfloat16 tower feeds its float32 connector)
        path = directory / "config.json"
        raw = json.loads(path.read_text())
        for part in (raw, raw["text_config"]):
            part["torch_dtype"] = spec.dtype
        path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    tokens_per_image = (spec.image_size // spec.patch_size) ** 2 // spec.scale_factor ** 2
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size={"longest_edge": spec.image_size},
                                              max_image_size={"longest_edge": spec.image_size},
                                              do_image_splitting=False),
        tokenizer=tokenizer, video_processor=SmolVLMVideoProcessor(), image_seq_len=tokens_per_image)
    processor.save_pretrained(directory)


# --- the checkpoint ------------------------------------------------------------------------------

def features(fx: VLAFixture):
    feats = {}
    for key, spec in fx.inputs.items():
        feats[key] = (PolicyFeature(FeatureType.VISUAL, (3, spec[1], spec[2])) if spec[0] == "camera"
                      else PolicyFeature(FeatureType.STATE, (spec[1],)))
    return feats, {"action": PolicyFeature(FeatureType.ACTION, (fx.action_dim,))}


def policy_config(fx: VLAFixture, vlm_dir: Path) -> SmolVLAConfig:
    feats, outs = features(fx)
    options = dict(fx.options)
    if "normalization_mapping" in options:
        from lerobot.configs import NormalizationMode
        options["normalization_mapping"] = {k: NormalizationMode(v)
                                            for k, v in dict(options["normalization_mapping"]).items()}
    return SmolVLAConfig(input_features=feats, output_features=outs, vlm_model_name=str(vlm_dir),
                         load_vlm_weights=False, device="cpu", **options)


def rename_vlm(directory: Path, hub_id: str) -> None:
    """Name the VLM by a hub-style id in config.json and the tokenizer step (see the module docstring)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["vlm_model_name"] = hub_id
    path.write_text(json.dumps(config, indent=4) + "\n")
    path = directory / "policy_preprocessor.json"
    pipeline = json.loads(path.read_text())
    for step in pipeline["steps"]:
        if step.get("registry_name") == TOKENIZER_STEP:
            step["config"]["tokenizer_name"] = hub_id
    path.write_text(json.dumps(pipeline, indent=2) + "\n")


def save_checkpoint(fx: VLAFixture, root: Path) -> None:
    """``root/vlm`` (the staged VLM) and ``root/pretrained_model`` (LeRobot's save_pretrained)."""
    vlm_dir, directory = root / "vlm", root / "pretrained_model"
    stage_vlm(fx.vlm, vlm_dir)
    torch.manual_seed(fx.seed)
    cfg = policy_config(fx, vlm_dir)
    policy = SmolVLAPolicy(cfg)
    pattern_weights_(policy, fx.seed)
    stats = {k: {s: torch.from_numpy(v) for s, v in d.items()} for k, d in fx.stats.items()}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    policy.save_pretrained(directory)
    pre.save_pretrained(directory)
    post.save_pretrained(directory)
    rename_vlm(directory, HUB_ID.format(name=fx.name))


def load_policy(directory: Path, vlm_dir: Path, rtc: Optional[dict] = None, device: str = "cpu"):
    """The checkpoint as a LeRobot user loads it offline: the VLM files named by override, on
    ``device`` (``policy.device`` and the processors' device step, as ``lerobot-eval`` sets them)."""
    from lerobot.configs.policies import PreTrainedConfig
    cfg = PreTrainedConfig.from_pretrained(directory)
    cfg.vlm_model_name = str(vlm_dir)
    cfg.device = device
    if rtc is not None:
        cfg.rtc_config = RTCConfig(enabled=True, prefix_attention_schedule=RTCAttentionSchedule(
            rtc["prefix_attention_schedule"]), max_guidance_weight=rtc["max_guidance_weight"],
            execution_horizon=rtc["execution_horizon"])
    policy = SmolVLAPolicy.from_pretrained(directory, config=cfg)
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(directory),
                                         preprocessor_overrides={TOKENIZER_STEP: {"tokenizer_name": str(vlm_dir)},
                                                                 "device_processor": {"device": device}})
    return policy, pre, post


class CounterFlowNoise:
    """Replaces SmolVLA's ``sample_noise`` by capsule_ros's counter-based draw of the step
    (``counter_normal((seed, step), (chunk_size, max_action_dim))``) and records each draw."""

    def __init__(self, policy: SmolVLAPolicy):
        self.rng_state = torch.zeros(2, dtype=torch.int64)
        self.draws: List[np.ndarray] = []
        self.draw_at: List[Tuple[int, int]] = []
        self.episode = 0

        def sample_noise(shape, device):
            assert shape[0] == 1, shape
            block = counter_normal(self.rng_state, tuple(shape[1:]))[None]
            self.draws.append(block[0].numpy().copy())
            self.draw_at.append((self.episode, int(self.rng_state[1])))
            return block.to(device)

        policy.model.sample_noise = sample_noise

    def at(self, episode: int, seed: int, step: int) -> None:
        self.episode = episode
        self.rng_state = torch.tensor([seed & 0xFFFFFFFF, step], dtype=torch.int64)


# --- inputs and rollouts ------------------------------------------------------------------------

def make_inputs(fx: VLAFixture) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(fx.seed)
    out: Dict[str, np.ndarray] = {}
    for key, spec in fx.inputs.items():
        if spec[0] == "camera":
            out[key] = np.stack([camera_frames(rng, STEPS, spec[1], spec[2]) for _ in range(EPISODES)])
        else:
            out[key] = np.stack([random_walk(rng, STEPS, spec[1]) for _ in range(EPISODES)])
    task = np.zeros((EPISODES, STEPS), np.int64)
    for episode, changes in SCHEDULE.items():
        for start, index in changes:
            task[episode, start:] = index
    out["task"] = task
    return out


def observation(fx: VLAFixture, inputs: Dict[str, np.ndarray], e: int, t: int) -> Dict[str, np.ndarray]:
    return {key: inputs[key][e, t].copy() for key in fx.inputs}


def select_action_rollout(fx: VLAFixture, directory: Path, vlm_dir: Path, inputs, seeds):
    """LeRobot's synchronous loop: ``predict_action`` with the step's task, every step."""
    policy, pre, post = load_policy(directory, vlm_dir)
    noise = CounterFlowNoise(policy)
    actions = np.zeros((EPISODES, STEPS, fx.action_dim), np.float32)
    for e in range(EPISODES):
        policy.reset()
        pre.reset()
        post.reset()
        for t in range(STEPS):
            noise.at(e, int(seeds[e]), t)
            task = TASKS[int(inputs["task"][e, t])]
            action = predict_action(observation(fx, inputs, e, t), policy, torch.device("cpu"), pre, post,
                                    use_amp=False, task=task)
            actions[e, t] = action.reshape(-1).numpy()
    return actions, np.stack(noise.draws).astype(np.float32), np.asarray(noise.draw_at, np.int64)


def fixed_delay_rollout(fx: VLAFixture, directory: Path, vlm_dir: Path, inputs, seeds, delay: int,
                        rtc: Optional[dict]) -> np.ndarray:
    """The fixed-delay loop of the module docstring (``rtc``: guidance settings, or None)."""
    policy, pre, post = load_policy(directory, vlm_dir, rtc)
    noise = CounterFlowNoise(policy)
    cfg = policy.config
    length = cfg.chunk_size
    horizon = min(cfg.n_action_steps, length - delay)
    end = horizon + delay
    actions = np.zeros((EPISODES, STEPS, fx.action_dim), np.float32)
    for e in range(EPISODES):
        policy.reset()
        pre.reset()
        post.reset()
        cursor, chunk, pending = end, None, None
        for t in range(STEPS):
            noise.at(e, int(seeds[e]), t)
            task = TASKS[int(inputs["task"][e, t])]
            with torch.no_grad():
                batch = pre(prepare_observation_for_inference(observation(fx, inputs, e, t), torch.device("cpu"),
                                                              task, None))
                if cursor == end:
                    if pending is None:
                        chunk, cursor = policy.predict_action_chunk(batch), 0
                    else:
                        chunk, pending, cursor = pending, None, delay
                if cursor == horizon:
                    kwargs = {}
                    if rtc is not None:
                        leftover = chunk[0, cursor:]          # the rows not executed before this step
                        kwargs = dict(inference_delay=delay, prev_chunk_left_over=_normalize_prev_actions_length(
                            leftover, target_steps=cfg.rtc_config.execution_horizon))
                    pending = policy.predict_action_chunk(batch, **kwargs)
                action = post(chunk[:, cursor])
                cursor += 1
            actions[e, t] = action.reshape(-1).numpy()
    return actions


def delays_for(fx: VLAFixture) -> List[int]:
    """Three delays d with d <= e = min(n_action_steps, L - d): the first, middle and last."""
    length, steps = int(fx.options["chunk_size"]), int(fx.options["n_action_steps"])
    valid = [d for d in range(1, length) if d <= min(steps, length - d)]
    return sorted({valid[0], valid[len(valid) // 2], valid[-1]})


def rtc_settings(fx: VLAFixture, rtc: dict, delay: int) -> dict:
    """``execution_horizon`` 0 means the leftover's own length, L - e (capsule_ros's default)."""
    length, steps = int(fx.options["chunk_size"]), int(fx.options["n_action_steps"])
    horizon = rtc["execution_horizon"] or length - min(steps, length - delay)
    return {**rtc, "execution_horizon": horizon}


def versions() -> Dict[str, str]:
    import platform
    return {"lerobot": lerobot.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__, "python": platform.python_version()}


def make(fx: VLAFixture) -> None:
    target = OUT / fx.name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    inputs = make_inputs(fx)
    seeds = np.asarray([1000 * fx.seed + e for e in range(EPISODES)], np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_checkpoint(fx, root)
        directory, vlm_dir = root / "pretrained_model", root / "vlm"
        select, noise, noise_at = select_action_rollout(fx, directory, vlm_dir, inputs, seeds)
        delays = delays_for(fx)
        runs: Dict[str, np.ndarray] = {}
        rtc_meta = []
        for delay in delays:
            runs[f"action_d{delay}"] = fixed_delay_rollout(fx, directory, vlm_dir, inputs, seeds, delay, None)
            for i, rtc in enumerate(fx.rtc):
                settings = rtc_settings(fx, rtc, delay)
                runs[f"action_d{delay}_rtc{i}"] = fixed_delay_rollout(fx, directory, vlm_dir, inputs, seeds, delay,
                                                                      settings)
                rtc_meta.append({"delay": delay, "index": i, **settings})
        tar_xz_tree(root, ("pretrained_model", "vlm"), target / "pretrained_model.tar.xz")
    np.savez_compressed(target / "inputs.npz", seeds=seeds, tasks=np.asarray(TASKS), **inputs)
    np.savez_compressed(target / "outputs.npz", action=select, noise=noise, noise_at=noise_at)
    length, steps = int(fx.options["chunk_size"]), int(fx.options["n_action_steps"])
    np.savez_compressed(target / "async.npz", delays=np.asarray(delays, np.int64),
                        horizons=np.asarray([min(steps, length - d) for d in delays], np.int64), **runs)
    meta = {"versions": versions(), "numerics": LEVEL, "episodes": EPISODES, "steps": STEPS, "policy": "smolvla",
            "inputs": {k: list(v) for k, v in fx.inputs.items()}, "options": dict(fx.options),
            "vlm": vars(fx.vlm), "vlm_model_name": HUB_ID.format(name=fx.name), "task_schedule": SCHEDULE,
            "rtc": rtc_meta, "delays": delays,
            "noise": "counter_normal((seed, step), (chunk_size, max_action_dim)) at each prediction"}
    (target / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    spread = float(select.std(axis=(0, 1)).min())
    differs = {k: float(np.abs(v - select).max()) for k, v in runs.items()}
    print(f"{fx.name}: actions {select.shape}, min per-dim std {spread:.3f}; max |async - sync| {differs}")


def main(argv: List[str]) -> None:
    torch.set_num_threads(1)
    wanted = set(argv)
    for fx in FIXTURES:
        if not wanted or fx.name in wanted:
            make(fx)


if __name__ == "__main__":
    main(sys.argv[1:])
