"""The policy kinds ``lerobot_pi0`` and ``lerobot_pi05``: a LeRobot π0 / π0.5
``pretrained_model/`` directory served by policy_node, fully offline (docs/vla.md)::

    policy:
      kind: lerobot_pi0                     # lerobot_pi05 for a π0.5 checkpoint
      weights: ''
      task: pick up the cube                # until the task port says another (or for good, without one)
      lerobot_pi0:
        pretrained_model: /robot/pi0/pretrained_model
        vlm_files: /robot/hub/paligemma-3b-pt-224   # the tokenizer files of google/paligemma-3b-pt-224
        features: ["observation.state:joints", "observation.images.top:top", "task:task"]

``build`` checks, in this order, each step raising ConfigError in one line naming the key,
file, tensor or port, before the next starts: the feature map against config.json and the
ports (``vla.kind``; ``empty_cameras`` features are the model's own, never a port's); the
checkpoint's options and dimensions (``architecture.read_architecture``: config.json and
the weights' header, no tensor data); the processor files (every step one capsule_ros
reproduces); the tokenizer (present, loadable offline, fitting the embedding); the
statistics; then the model is built on the meta device and ``model.safetensors`` loaded
into it strictly by LeRobot's names (``loading``: names, shapes, dtypes).

The fingerprint covers config.json (hence the dimensions, the dtype, the token length, the
denoising steps), the dtype of every weight (the weights digest), the tokenizer's options,
vocabulary and file digests, the RTC settings, and the versions of transformers and
tokenizers, whose code computes the layers and the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict

import torch

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import (
    POSTPROCESSOR_FILE,
    PREPROCESSOR_FILE,
    Checkpoint,
    processor_steps,
    read_checkpoint,
    read_normalization,
)
from capsule_ros.policies.lerobot.pi import policy as pi_policy
from capsule_ros.policies.lerobot.pi.architecture import PiArchitecture, read_architecture
from capsule_ros.policies.lerobot.pi.loading import load_weights
from capsule_ros.policies.lerobot.pi.model import FLOAT32_PARAMS, PiModel
from capsule_ros.policies.lerobot.pi.prompt import clean_task
from capsule_ros.policies.registry import BuildContext, PolicyKind
from capsule_ros.policies.vla.kind import VLASettings, bind_inputs, files_digest, local_files
from capsule_ros.policies.vla.policy import TASK_BUFFER
from capsule_ros.policies.vla.rtc import RTCSettings
from capsule_ros.policies.vla.tokens import TOKENIZER_STEP, TaskTokenizer, load_tokenizer, tokenizer_options
from capsule_ros.runtime.policy import STANDARD_NAMES

RESERVED = (*STANDARD_NAMES, TASK_BUFFER, *pi_policy.BUFFER_NAMES)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json")
OBS_STATE = "observation.state"
EMPTY_CAMERA = "observation.images.empty_camera_"
# preprocessor steps, by LeRobot's registry names, that the policy reproduces
NEWLINE = "pi0_new_line_processor"
STATE_PROMPT = "pi05_prepare_state_tokenizer_processor_step"
RELATIVE, ABSOLUTE = "relative_actions_processor", "absolute_actions_processor"
EXPECTED_STEPS = {"pi0": (NEWLINE, TOKENIZER_STEP, RELATIVE), "pi05": (STATE_PROMPT, TOKENIZER_STEP, RELATIVE)}


@dataclass(frozen=True)
class Pi0Settings(VLASettings):
    """π0 from a LeRobot checkpoint: its directory, the tokenizer's files and the ports that feed it."""

    SECTION = "policy.lerobot_pi0"


@dataclass(frozen=True)
class Pi05Settings(VLASettings):
    """π0.5 from a LeRobot checkpoint: its directory, the tokenizer's files and the ports that feed it."""

    SECTION = "policy.lerobot_pi05"


def without_empty_cameras(checkpoint: Checkpoint, arch: PiArchitecture) -> Checkpoint:
    """The checkpoint's input features less ``empty_camera_<i>`` (i < empty_cameras), which
    LeRobot's ``validate_features`` adds to config.json and pads itself: no port feeds them."""
    own = {f"{EMPTY_CAMERA}{i}" for i in range(arch.empty_cameras)}
    return replace(checkpoint, inputs={k: f for k, f in checkpoint.inputs.items() if k not in own})


def check_processors(checkpoint: Checkpoint) -> None:
    """The prompt steps are LeRobot's for the checkpoint's type, in LeRobot's order, and the
    relative / absolute action steps are disabled (every other step is checked by
    ``read_normalization``: passive, or one the policy reproduces)."""
    kind = checkpoint.policy_type
    where = checkpoint.directory / PREPROCESSOR_FILE
    steps = processor_steps(checkpoint, PREPROCESSOR_FILE) + processor_steps(checkpoint, POSTPROCESSOR_FILE)
    for step in steps:
        name, config = step.get("registry_name"), step.get("config") or {}
        if name in (RELATIVE, ABSOLUTE) and config.get("enabled", False):
            raise ConfigError(f"{checkpoint.directory}: the {name} step is enabled: relative actions keep the "
                              "processor's last state outside the policy, which capsule_ros does not serve")
    names = [str(step.get("registry_name")) for step in processor_steps(checkpoint, PREPROCESSOR_FILE)]
    if names.count(TOKENIZER_STEP) != 1:
        raise ConfigError(f"{where}: expected one {TOKENIZER_STEP!r} step, found {names.count(TOKENIZER_STEP)}")
    prompt_step = EXPECTED_STEPS[kind][0]
    if prompt_step not in names[:names.index(TOKENIZER_STEP)]:
        raise ConfigError(f"{where}: no {prompt_step!r} step before the tokenizer: not a LeRobot {kind} pipeline")
    if kind == "pi05" and ("normalizer_processor" not in names
                           or names.index("normalizer_processor") > names.index(STATE_PROMPT)):
        raise ConfigError(f"{where}: {STATE_PROMPT!r} before the normaliser: the state would enter the prompt "
                          "unnormalised, which LeRobot's own pipeline never does")


def tokenizer_config(checkpoint: Checkpoint) -> dict:
    """The tokenizer step's config in ``policy_preprocessor.json``."""
    steps = processor_steps(checkpoint, PREPROCESSOR_FILE)
    return next((step.get("config") or {} for step in steps if step.get("registry_name") == TOKENIZER_STEP), {})


def build(context: BuildContext) -> pi_policy.PiPolicy:
    """The checkpoint's π0 / π0.5 for the configured ports (checks first: module docstring)."""
    settings = context.settings
    assert isinstance(settings, (Pi0Settings, Pi05Settings))
    where = settings.SECTION
    expected = "pi0" if isinstance(settings, Pi0Settings) else "pi05"
    if context.weights is not None:
        raise ConfigError(f"policy.weights = {str(context.weights)!r}: a LeRobot policy reads its weights from "
                          f"{where}.pretrained_model; set policy.weights to ''")
    full = read_checkpoint(Path(settings.pretrained_model).expanduser())
    if full.policy_type != expected:
        raise ConfigError(f"{full.directory}/config.json: type is {full.policy_type!r}, expected {expected!r}")
    arch = read_architecture(full)
    checkpoint = without_empty_cameras(full, arch)
    options = tokenizer_options(checkpoint, NEWLINE)
    inputs, task_port = bind_inputs(checkpoint, settings, context, RESERVED, options.max_length)
    check_processors(checkpoint)
    if options.padding != "max_length":
        raise ConfigError(f"{checkpoint.directory / PREPROCESSOR_FILE}: tokenizer_processor padding = "
                          f"{options.padding!r}: LeRobot's {expected} pads to max_length (a fixed token length)")
    hub_name = str((tokenizer_config(checkpoint)).get("tokenizer_name", ""))
    files = local_files(settings.vlm_files, hub_name, f"{where}.vlm_files")
    hf_tokenizer = load_tokenizer(files, f"{where}.vlm_files")
    what = f"{where}.vlm_files ({files})"
    tokenizer = TaskTokenizer(hf_tokenizer, options, arch.vocab_size, what,
                              prompt=None if expected == "pi0" else clean_task)
    prompt_tokenizer = TaskTokenizer(hf_tokenizer, options, arch.vocab_size, what) if expected == "pi05" else None
    input_norms, action_norm = read_normalization(checkpoint, handled=(*EXPECTED_STEPS[expected], ABSOLUTE))
    with torch.device("meta"):
        model = PiModel(arch)
    policy = pi_policy.PiPolicy(checkpoint, inputs, input_norms, action_norm, model=model, tokenizer=tokenizer,
                                prompt_tokenizer=prompt_tokenizer, task_port=task_port, default_task=context.task,
                                rtc=context.rtc or RTCSettings(), description=describe(arch, files))
    load_weights(full, model)
    model.materialize_constants()
    left = [name for name, t in list(policy.named_parameters()) + list(policy.named_buffers()) if t.is_meta]
    if left:
        raise ConfigError(f"{expected}: {len(left)} tensors were not loaded ({', '.join(left[:3])})")
    return policy.eval()


def describe(arch: PiArchitecture, files: Path) -> Dict[str, object]:
    """What changes the numbers besides config.json and the weights (module docstring)."""
    import tokenizers
    import transformers
    return {"dtype": arch.dtype, "float32_params": list(FLOAT32_PARAMS) if arch.dtype == "bfloat16" else [],
            "tokenizer_files": files_digest(files, TOKENIZER_FILES),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


PI0_KIND = PolicyKind("lerobot_pi0", Pi0Settings, build,
                      "π0 from a LeRobot pretrained_model/ directory and the PaliGemma tokenizer's files (offline)")
PI05_KIND = PolicyKind("lerobot_pi05", Pi05Settings, build,
                       "π0.5 from a LeRobot pretrained_model/ directory and the PaliGemma tokenizer's files (offline)")
