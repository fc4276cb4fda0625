"""Reading a LeRobot ``pretrained_model/`` directory: config, processor statistics, weights.

LeRobot's ``save_pretrained`` (0.4.x) writes:

- ``config.json``: the policy config (``type``, ``input_features`` / ``output_features``
  as ``{key: {"type": STATE|VISUAL|ENV|ACTION, "shape": [...]}}``, architecture fields);
- ``model.safetensors``: the policy's state dict, by parameter name;
- ``policy_preprocessor.json`` / ``policy_postprocessor.json``: the processor pipelines,
  a list of steps ``{"registry_name", "config", "state_file"?}``; the normaliser steps keep
  their statistics in ``<pipeline>_step_<i>_<registry_name>.safetensors`` as flat
  ``"<feature key>.<stat>"`` tensors.

Everything is read without pickle: JSON, and safetensors through the ``safetensors``
library (``capsule_ros.runtime.weights``). ``read_checkpoint`` reads config.json only (cheap: validation happens before
any weights load); statistics and weights are read by the builders afterwards.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from capsule_ros.errors import ConfigError
from capsule_ros.runtime.weights import load_strict, read_weights

LOG = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
ACTION_KEY = "action"

# Processor steps that do not change values at batch size 1 on one device.
_PASSIVE_STEPS = {"rename_observations_processor", "to_batch_processor", "device_processor"}
NORMALIZATION_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
# mode -> the two statistics it reads (low, spread) from the state file
STATS_OF_MODE = {"MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"),
                 "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}


@dataclass(frozen=True)
class Feature:
    """One policy feature as config.json declares it."""

    key: str
    type: str                  # STATE, VISUAL, ENV, ACTION
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Normalization:
    """How LeRobot's (un)normaliser treats one feature: mode and its statistics."""

    key: str
    mode: str                             # one of NORMALIZATION_MODES
    stats: Mapping[str, torch.Tensor]     # stat name -> float32 tensor (empty for IDENTITY)
    eps: float


@dataclass(frozen=True)
class Checkpoint:
    """A LeRobot checkpoint directory and its parsed config.json."""

    directory: Path
    config: Mapping[str, object]
    inputs: Mapping[str, Feature]          # in config order (LeRobot's camera order)
    action: Feature

    @property
    def policy_type(self) -> str:
        return str(self.config.get("type"))

    @property
    def action_dim(self) -> int:
        return self.action.shape[0]

    def field(self, name: str, default=None):
        return self.config.get(name, default)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (is {path.parent} a LeRobot pretrained_model directory?)") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _features(path: Path, raw: object, what: str) -> Dict[str, Feature]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {what} must be an object of feature key -> {{type, shape}}")
    out = {}
    for key, entry in raw.items():
        try:
            out[key] = Feature(key, str(entry["type"]), tuple(int(d) for d in entry["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: {what}[{key!r}] is malformed: {exc}") from exc
    return out


def read_checkpoint(directory) -> Checkpoint:
    """Parse ``config.json`` of a LeRobot ``pretrained_model/`` directory (nothing else)."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    config = _read_json(path)
    inputs = _features(path, config.get("input_features"), "input_features")
    outputs = _features(path, config.get("output_features"), "output_features")
    if ACTION_KEY not in outputs or len(outputs[ACTION_KEY].shape) != 1:
        raise ConfigError(f"{path}: output_features must hold {ACTION_KEY!r} with a 1-D shape, got {sorted(outputs)}")
    return Checkpoint(directory, config, inputs, outputs[ACTION_KEY])


# --- processors ------------------------------------------------------------------------------

def processor_steps(checkpoint: Checkpoint, filename: str) -> List[dict]:
    """The steps of a processor pipeline file, as saved (``registry_name``, ``config``, ...)."""
    path = checkpoint.directory / filename
    steps = _read_json(path).get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
        raise ConfigError(f"{path}: 'steps' must be a list of objects")
    return steps


def _normalizer_step(checkpoint: Checkpoint, filename: str, registry_name: str,
                     handled: Collection[str] = ()) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """The single (un)normaliser step of a pipeline: its config and its statistics.

    Steps that do not change values (rename, batch, device without a dtype cast) are
    accepted, and so are the ``handled`` ones (which the policy reproduces itself, e.g. a
    VLA's task tokenizer); any other step would change what the policy sees, so it is
    refused by name.
    """
    path = checkpoint.directory / filename
    found: Optional[Tuple[dict, Dict[str, torch.Tensor]]] = None
    for step in processor_steps(checkpoint, filename):
        name = step.get("registry_name")
        config = step.get("config") or {}
        if name == registry_name:
            if found is not None:
                raise ConfigError(f"{path}: more than one {registry_name!r} step")
            state_file = step.get("state_file")
            stats = read_weights(checkpoint.directory / state_file)[0] if state_file else {}
            found = (config, stats)
        elif name == "device_processor" and config.get("float_dtype") not in (None, "float32"):
            raise ConfigError(f"{path}: device_processor casts to {config.get('float_dtype')!r}; "
                              "only float32 is supported")
        elif name not in _PASSIVE_STEPS and name not in handled:
            raise ConfigError(f"{path}: processor step {name!r} is not supported "
                              f"(supported: {sorted(_PASSIVE_STEPS | {registry_name} | set(handled))})")
    if found is None:
        raise ConfigError(f"{path}: no {registry_name!r} step")
    return found


def _normalization(path_hint: str, config: dict, stats: Dict[str, torch.Tensor], feature: Feature) -> Normalization:
    """LeRobot's ``_apply_transform`` rule for one feature: the mode its type maps to, or
    identity when the feature is not listed, not selected, or has no statistics."""
    eps = float(config.get("eps", 1e-8))
    listed = config.get("features", {})
    selected = config.get("normalize_observation_keys")
    mode = str(config.get("norm_map", {}).get(feature.type, "IDENTITY"))
    if mode not in NORMALIZATION_MODES:
        raise ConfigError(f"{path_hint}: normalisation mode {mode!r} for {feature.type} is not supported "
                          f"({', '.join(NORMALIZATION_MODES)})")
    prefix = feature.key + "."
    own = {name[len(prefix):]: t.to(torch.float32) for name, t in stats.items()
           if name.startswith(prefix) and "." not in name[len(prefix):]}
    skipped = feature.key not in listed or (selected is not None and feature.type != "ACTION"
                                            and feature.key not in selected)
    if mode == "IDENTITY" or skipped or not own:
        return Normalization(feature.key, "IDENTITY", {}, eps)
    needed = STATS_OF_MODE[mode]
    missing = [s for s in needed if s not in own]
    if missing:
        raise ConfigError(f"{path_hint}: {feature.key!r} is normalised {mode} but its statistics lack {missing}")
    return Normalization(feature.key, mode, {s: own[s] for s in needed}, eps)


def read_normalization(checkpoint: Checkpoint,
                       handled: Collection[str] = ()) -> Tuple[Dict[str, Normalization], Normalization]:
    """(input key -> Normalization, the action's unnormalisation) from the processor files;
    ``handled``: pre- or postprocessor steps the policy reproduces itself (see ``_normalizer_step``)."""
    pre_config, pre_stats = _normalizer_step(checkpoint, PREPROCESSOR_FILE, "normalizer_processor", handled)
    post_config, post_stats = _normalizer_step(checkpoint, POSTPROCESSOR_FILE, "unnormalizer_processor", handled)
    inputs = {key: _normalization(PREPROCESSOR_FILE, pre_config, pre_stats, feature)
              for key, feature in checkpoint.inputs.items()}
    action = _normalization(POSTPROCESSOR_FILE, post_config, post_stats, checkpoint.action)
    return inputs, action


# --- weights ---------------------------------------------------------------------------------

def load_model_weights(checkpoint: Checkpoint, module: nn.Module, *, training_only: Iterable[str] = (),
                       assign: bool = False) -> None:
    """Load ``model.safetensors`` into ``module`` by LeRobot's parameter names, strictly.

    ``training_only``: name prefixes the file holds but inference never reads (ACT's VAE
    encoder); they are skipped. Any other missing, unexpected or mis-shaped name is listed
    in the error. ``assign``: the file's tensors become the parameters (a module built on
    the meta device, with no memory of its own yet).
    """
    path = checkpoint.directory / MODEL_FILE
    tensors = unwrap_compiled(read_weights(path)[0], path)
    skip = tuple(training_only)
    tensors = {k: v for k, v in tensors.items() if not k.startswith(skip)} if skip else tensors
    load_strict(module, tensors, f"{path} does not fit the {checkpoint.policy_type} policy its config.json describes",
                assign=assign)


COMPILED = "._orig_mod."     # what torch.compile's wrapper puts in the names of the module it wraps


def unwrap_compiled(tensors: Dict[str, torch.Tensor], path: Path) -> Dict[str, torch.Tensor]:
    """The names a checkpoint would have without ``torch.compile``'s wrapper: a policy trained
    with LeRobot's ``compile_model: true`` (Diffusion's U-Net) is saved under
    ``diffusion.unet._orig_mod.*``; the wrapper holds no tensor of its own, so dropping the
    segment gives the plain module's names (LeRobot loads such a file by compiling again)."""
    if not any(COMPILED in name for name in tensors):
        return tensors
    out: Dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        plain = name.replace(COMPILED, ".")
        if plain in out:
            raise ConfigError(f"{path}: holds both {plain!r} and its torch.compile name {name!r}; save it again "
                              "with compile_model: false")
        out[plain] = value
    LOG.info("%s: names of a torch.compile'd module (compile_model: true) read without '_orig_mod'", path)
    return out
