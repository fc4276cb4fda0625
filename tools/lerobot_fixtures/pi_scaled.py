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

``build_tokenizer`` writes a tokenizer in the format LeRobot's ``TokenizerProcessorStep``
loads for PaliGemma (``AutoTokenizer`` -> transformers' ``GemmaTokenizer``: byte-fallback
BPE, ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 added in front, ``<unk>`` 3): the byte tokens,
ASCII letters, digits (never merged, as Gemma splits digits), punctuation, the newline,
and merges for the words of the fixtures' prompts. No hub access anywhere.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Tuple


@dataclass(frozen=True)
class GemmaDims:
    """One Gemma stack, as LeRobot's ``GemmaConfig`` (openpi's variant table) holds it."""

    width: int
    depth: int
    mlp_dim: int
    head_dim: int
    num_heads: int = 8          # LeRobot's interleaved forward assumes 8 query heads
    num_kv_heads: int = 1


@dataclass(frozen=True)
class ScaledPi:
    """The dimensions LeRobot fixes for π0 / π0.5, scaled down."""

    variants: Dict[str, GemmaDims] = field(default_factory=dict)   # variant name -> dims
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_mlp: int = 128
    vision_heads: int = 16     # PaliGemma's default; LeRobot never changes it
    patch_size: int = 8
    vocab_size: int = 512


TINY = ScaledPi(variants={"scaled_vlm_64": GemmaDims(width=64, depth=2, mlp_dim=128, head_dim=16),
                          "scaled_expert_32": GemmaDims(width=32, depth=2, mlp_dim=64, head_dim=16)})


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
            vision.hidden_size, vision.num_hidden_layers = scale.vision_hidden, scale.vision_layers
            vision.intermediate_size, vision.num_attention_heads = scale.vision_mlp, scale.vision_heads
            vision.patch_size = scale.patch_size
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


# --- tokenizer --------------------------------------------------------------------------------

SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
PUNCTUATION = ",.:;!?'-()_"
WORDS = ("Task", "State", "Action", "▁pick", "▁up", "▁the", "▁cube", "▁place", "▁red", "▁blue", "▁on", "▁put",
         "▁block", "▁green", "▁stack", "▁it", "▁and", "▁then", "▁open", "▁drawer", "▁close", "▁gripper")


def tokenizer_vocab() -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """(vocab, merges) of the fixtures' tokenizer (module docstring)."""
    vocab: Dict[str, int] = {token: i for i, token in enumerate(SPECIAL)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    for token in ["▁", "\n", *letters, *"0123456789", *PUNCTUATION]:
        vocab.setdefault(token, len(vocab))
    merges: List[Tuple[str, str]] = []
    for word in WORDS:
        current = word[0]
        for char in word[1:]:
            joined = current + char
            if joined not in vocab:
                vocab[joined] = len(vocab)
                merges.append((current, char))
            current = joined
    return vocab, merges


def build_tokenizer(directory: Path) -> int:
    """Write the tokenizer files into ``directory``; returns its vocabulary size."""
    from transformers import GemmaTokenizer

    vocab, merges = tokenizer_vocab()
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    return len(tokenizer)
