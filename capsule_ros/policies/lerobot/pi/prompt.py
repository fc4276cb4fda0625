"""The task prompt of π0 / π0.5, tokenised on the host exactly as LeRobot 0.6.1's preprocessor does.

LeRobot's pipelines (``pi0/processor_pi0.py``, ``pi05/processor_pi05.py``):

- π0: ``Pi0NewLineProcessor`` appends ``"\\n"`` unless the task ends with one; the
  prompt is the task alone (an absent or empty task is ``""``, as
  ``prepare_observation_for_inference`` sets it, so the prompt is ``"\\n"``);
- π0.5: ``Pi05PrepareStateTokenizerProcessorStep`` runs after the normaliser: the
  normalised state is discretised into 256 bins over [-1, 1]
  (``np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1``: -1 below, 255 above) and the
  prompt is ``f"Task: {cleaned}, State: {' '.join(bins)};\\nAction: "`` with
  ``cleaned = task.strip().replace("_", " ").replace("\\n", " ")``;
- then ``TokenizerProcessorStep``: the checkpoint's tokenizer (transformers'
  ``AutoTokenizer``, here from a local directory) called on ``[prompt]`` with the step's
  ``max_length``, ``truncation``, ``padding`` and ``padding_side``: int64 ids and a bool
  attention mask of exactly ``max_length`` (capsule_ros needs the fixed length:
  ``padding: max_length`` with truncation, LeRobot's setting for π0 / π0.5).

The same library does the tokenising, so the ids are LeRobot's by construction; the
prompt strings are built here with LeRobot's own expressions (Python's ``str`` of a
numpy int64 for the bins). ``tokenize`` runs on the host, at the step that plans a chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from capsule_ros.errors import ConfigError

STATE_BINS = np.linspace(-1, 1, 256 + 1)[:-1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class TokenizerStep:
    """The ``tokenizer_processor`` step of a checkpoint's ``policy_preprocessor.json``."""

    max_length: int
    padding_side: str
    padding: str
    truncation: bool
    task_key: str
    tokenizer_name: str

    @classmethod
    def from_config(cls, config: dict, where: str) -> TokenizerStep:
        step = cls(max_length=int(config.get("max_length", 512)), padding_side=str(config.get("padding_side", "right")),
                   padding=str(config.get("padding", "max_length")), truncation=bool(config.get("truncation", True)),
                   task_key=str(config.get("task_key", "task")), tokenizer_name=str(config.get("tokenizer_name", "")))
        if step.padding != "max_length" or not step.truncation:
            raise ConfigError(f"{where}: tokenizer_processor pads {step.padding!r} with truncation {step.truncation}: "
                              "capsule_ros needs a fixed token length (padding 'max_length' with truncation, "
                              "LeRobot's π0 / π0.5 setting)")
        if step.padding_side not in ("left", "right"):
            raise ConfigError(f"{where}: tokenizer_processor padding_side {step.padding_side!r}: 'left' or 'right'")
        if step.task_key != "task":
            raise ConfigError(f"{where}: tokenizer_processor task_key {step.task_key!r}: only 'task' is supported")
        return step


def load_tokenizer(directory: Path, hub_name: str, vocab_rows: int):
    """The checkpoint's tokenizer from a local directory, checked against the embedding
    (``vocab_rows`` rows): ConfigError in one line when it is missing or does not fit."""
    directory = Path(directory).expanduser()
    named = f" ({hub_name}'s tokenizer files)" if hub_name else ""
    if not directory.is_dir() or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"tokenizer directory {str(directory)!r} holds no tokenizer{named}: stage "
                          f"{' or '.join(TOKENIZER_FILES)} and tokenizer_config.json there (docs/vla.md)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"tokenizer directory {str(directory)!r}: transformers cannot load it ({exc})".replace(
            "\n", " ")) from None
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if len(tokenizer) > vocab_rows or largest >= vocab_rows:
        raise ConfigError(f"tokenizer {str(directory)!r} has {len(tokenizer)} tokens (largest id {largest}), but the "
                          f"checkpoint's embedding has {vocab_rows} rows: it is not this checkpoint's tokenizer")
    return tokenizer


class Prompt:
    """Task (and π0.5's state) -> token ids and mask, as LeRobot's preprocessor makes them."""

    def __init__(self, kind: str, tokenizer, step: TokenizerStep):
        self.kind, self.tokenizer, self.step = kind, tokenizer, step

    @property
    def length(self) -> int:
        return self.step.max_length

    def text(self, task: str, normalized_state: Optional[np.ndarray] = None) -> str:
        """The prompt string (module docstring); ``normalized_state`` float32 [n] for π0.5."""
        task = task if task else ""
        if self.kind == "pi0":
            return task if task.endswith("\n") else f"{task}\n"
        assert normalized_state is not None, "π0.5's prompt carries the normalised state"
        discretized = np.digitize(normalized_state[None], bins=STATE_BINS) - 1
        cleaned = task.strip().replace("_", " ").replace("\n", " ")
        state_str = " ".join(map(str, discretized[0]))
        return f"Task: {cleaned}, State: {state_str};\nAction: "

    def tokenize(self, task: str, normalized_state: Optional[np.ndarray] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [max_length], attention mask bool [max_length])."""
        step = self.step
        out = self.tokenizer([self.text(task, normalized_state)], max_length=step.max_length,
                             truncation=step.truncation, padding=step.padding, padding_side=step.padding_side,
                             return_tensors="pt")
        return out["input_ids"][0], out["attention_mask"][0].to(dtype=torch.bool)
