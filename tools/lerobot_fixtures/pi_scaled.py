"""Scaled-down π0 / π0.5 for LeRobot 0.6.1, and a small local PaliGemma-format tokenizer.

LeRobot builds π0 and π0.5 only at PaliGemma-3B's size: ``PI0Config`` / ``PI05Config``
accept the Gemma variants ``gemma_2b`` and ``gemma_300m`` only, ``get_gemma_config`` maps
them to their dimensions, and ``PaliGemmaWithExpertModel.__init__`` fixes the rest (the
SigLIP tower of transformers' ``PaliGemmaConfig`` defaults, vision MLP 4304, projection 2048,
a vocabulary of 257152). A checkpoint for tests or CPU benchmarks needs a model a few
hundred kilobytes large, so ``scaled_pi`` patches exactly those points, and nothing
else, for the duration of a ``with`` block:

- ``get_gemma_config`` of both modeling modules also knows the variants of ``ScaledPi``
  (named in config.json as ``paligemma_variant`` / ``action_expert_variant``);
- the configs' ``__post_init__`` accept those names (LeRobot's own check is kept for
  every other name);
- the PaliGemma model and the expert get the scaled vision tower, projection and
  vocabulary before they are built (every other config value is LeRobot's).

Everything else (the layers, the forward, the processors, ``save_pretrained`` /
``from_pretrained``) is LeRobot's unchanged code. A checkpoint saved this way loads in
LeRobot only inside the same ``with`` block; capsule_ros reads it as it reads any π0
checkpoint (the dimensions a variant name does not give come from the weights' shapes).

The scaled dimensions (``TINY``) and the tokenizer (``build_tokenizer``: the format LeRobot's
``TokenizerProcessorStep`` loads for PaliGemma) are capsule_ros's benchmark writer's
(``capsule_ros/benchmarks/lerobot_pi.py``), so fixtures and benchmarks share them. No hub
access anywhere.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from capsule_ros.benchmarks.lerobot_pi import TINY as BENCH_TINY, PiSpec, write_tokenizer
from capsule_ros.policies.lerobot.checkpoint import read_checkpoint
from capsule_ros.policies.lerobot.pi.architecture import LEROBOT_VARIANTS, GemmaDims, VisionDims, read_architecture


@dataclass(frozen=True)
class ScaledPi:
    """The dimensions LeRobot fixes for π0 / π0.5, scaled down: the Gemma variants by name,
    the SigLIP tower, the vocabulary (capsule_ros's own dataclasses)."""

    variants: Dict[str, GemmaDims]
    vision: VisionDims
    vocab_size: int

    @classmethod
    def of(cls, spec: PiSpec) -> ScaledPi:
        return cls(variants=dict(spec.dims), vision=spec.vision, vocab_size=spec.vocab_size)

    @classmethod
    def of_checkpoint(cls, directory: Path) -> ScaledPi:
        """The scale of a saved checkpoint, as capsule_ros reads it (config.json and the
        weights' shapes): its variants by the names config.json gives them."""
        checkpoint = read_checkpoint(directory)
        arch = read_architecture(checkpoint)
        names = (str(checkpoint.field("paligemma_variant")), str(checkpoint.field("action_expert_variant")))
        variants = {name: dims for name, dims in zip(names, (arch.vlm, arch.expert), strict=True)
                    if name not in LEROBOT_VARIANTS}
        return cls(variants=variants, vision=arch.vision, vocab_size=arch.vocab_size)


TINY = ScaledPi.of(BENCH_TINY)


@contextlib.contextmanager
def scaled_pi(scale: ScaledPi) -> Iterator[None]:
    """LeRobot's π0 and π0.5 build ``scale``'s variants inside the block (module docstring)."""
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from lerobot.policies.pi05 import modeling_pi05
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    saved: List[Tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module in (modeling_pi0, modeling_pi05):
        original_get = module.get_gemma_config
        original_paligemma = module.PaliGemmaForConditionalGenerationWithPiGemma
        original_expert = module.PiGemmaForCausalLM

        def get_gemma_config(variant: str, _module=module, _original=original_get):
            dims = scale.variants.get(variant)
            if dims is None:
                return _original(variant)
            return _module.GemmaConfig(width=dims.width, depth=dims.depth, mlp_dim=dims.mlp_dim,
                                       num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads,
                                       head_dim=dims.head_dim)

        def paligemma(config, _original=original_paligemma):
            vision = config.vision_config
            vision.hidden_size, vision.num_hidden_layers = scale.vision.hidden, scale.vision.layers
            vision.intermediate_size, vision.num_attention_heads = scale.vision.mlp, scale.vision.heads
            vision.patch_size = scale.vision.patch
            vision.projection_dim = config.text_config.hidden_size
            config.text_config.vocab_size = scale.vocab_size
            config._vocab_size = scale.vocab_size
            config.image_token_index = scale.vocab_size
            return _original(config=config)

        def expert(config, _original=original_expert):
            config.vocab_size = scale.vocab_size
            return _original(config=config)

        patch(module, "get_gemma_config", get_gemma_config)
        patch(module, "PaliGemmaForConditionalGenerationWithPiGemma", paligemma)
        patch(module, "PiGemmaForCausalLM", expert)

    for config_cls in (PI0Config, PI05Config):
        original_post_init = config_cls.__post_init__

        def post_init(self, _original=original_post_init):
            names = (self.paligemma_variant, self.action_expert_variant)
            if names[0] in scale.variants:
                self.paligemma_variant = "gemma_2b"
            if names[1] in scale.variants:
                self.action_expert_variant = "gemma_300m"
            _original(self)
            self.paligemma_variant, self.action_expert_variant = names

        patch(config_cls, "__post_init__", post_init)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def load_pi(checkpoint: Path, tokenizer: Path, device: str = "cpu"):
    """(policy, preprocessor, postprocessor) of a π0 / π0.5 checkpoint as a LeRobot user loads
    it offline (``from_pretrained``, ``make_pre_post_processors`` with the tokenizer's local
    directory as an override), scaled as its weights say (nothing to patch at LeRobot's size),
    then moved to ``device`` (``policy.device`` and the processors' device step, as
    ``lerobot-eval`` sets them)."""
    import json

    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from transformers.initialization import no_init_weights
    kind = json.loads((checkpoint / "config.json").read_text())["type"]
    # the file gives every weight (``check_loaded``): LeRobot's random initialisation first is
    # skipped, as transformers skips it when it loads a checkpoint (a 3B π's load took LeRobot's
    # process 115-133 s on a GPU host, its model built with random weights on the CPU first)
    with scaled_pi(ScaledPi.of_checkpoint(checkpoint)), no_init_weights():
        policy = (PI05Policy if kind == "pi05" else PI0Policy).from_pretrained(checkpoint)
    check_loaded(policy, checkpoint / "model.safetensors")
    policy.config.device = device
    policy.to(device)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(checkpoint),
                                         preprocessor_overrides={"tokenizer_processor":
                                                                 {"tokenizer_name": str(tokenizer)},
                                                                 "device_processor": {"device": device}})
    return policy, pre, post


def check_loaded(policy, weights: Path) -> None:
    """LeRobot's π0 ``from_pretrained`` prints a warning and keeps the weights it started from
    when the file does not load: refuse that here (every tensor of the file must be in the
    policy, and every tensor of the policy's state in the file: none is left as it was built)."""
    from safetensors.torch import load_file
    state = policy.state_dict()
    loaded = load_file(str(weights))
    for name, tensor in loaded.items():
        if name not in state or not torch.equal(state[name].to(tensor.dtype), tensor):
            raise RuntimeError(f"LeRobot did not load {weights}: {name} is not the file's (random weights?)")
    unloaded = sorted(set(state) - set(loaded))
    if unloaded:
        raise RuntimeError(f"{weights} does not hold {len(unloaded)} of the policy's tensors ({unloaded[:3]}): "
                           "they would keep the uninitialised memory they were built with")


def build_tokenizer(directory: Path) -> int:
    """The fixtures' tokenizer (``capsule_ros.benchmarks.lerobot_pi.write_tokenizer``)."""
    return write_tokenizer(directory)
