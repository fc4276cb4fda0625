"""The task instruction as a fixed-length token buffer, tokenised as LeRobot's processor does.

LeRobot's VLA preprocessors turn the ``task`` string of an observation into
``observation.language.tokens`` and ``.attention_mask`` on the host, at every step:
``NewLineTaskProcessorStep`` appends ``"\\n"`` unless the task ends with one, then
``TokenizerProcessorStep`` calls the checkpoint's own tokenizer (``AutoTokenizer`` of the
VLM's files) as ``tokenizer([task], max_length=..., truncation=..., padding=...,
padding_side=..., return_tensors="pt")``. capsule_ros does the same, with the same
tokenizer class and files, when a task arrives (a ``std_msgs/msg/String`` port, or the
``policy.task`` default), and writes the result into one int64 buffer of the arena:

    [2, max_length]: row 0 the token ids, row 1 the attention mask (1 for a token, 0 for padding)

With ``padding: longest`` (SmolVLA's default) LeRobot's ids have the task's own length;
the buffer holds them followed by padding (the tokenizer's pad id, mask 0), and the policy
uses the first ``mask.sum()`` tokens (``token_count``). With ``max_length`` the tokenizer pads
itself and the buffer is its output as it is. An instruction longer than ``max_length``
tokens is truncated by the tokenizer, as in LeRobot; an empty one becomes ``"\\n"``, as in
LeRobot (``prepare_observation_for_inference`` makes a missing task ``""``).

Loading is offline (``local_files_only``) and checked at configure: a directory without a
tokenizer, a tokenizer with more tokens than the text embedding has rows, or one that
cannot pad as the checkpoint asks, is refused in one line naming it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from capsule_ros.errors import ConfigError
from capsule_ros.policies.lerobot.checkpoint import PREPROCESSOR_FILE, processor_steps

NEWLINE_STEP = "smolvla_new_line_processor"     # LeRobot's NewLineTaskProcessorStep (registry name)
TOKENIZER_STEP = "tokenizer_processor"          # LeRobot's TokenizerProcessorStep
TOKENS, MASK = 0, 1                             # rows of the token buffer


@dataclass(frozen=True)
class TokenizerOptions:
    """The tokenizer step's configuration, as the checkpoint's ``policy_preprocessor.json`` holds it."""

    max_length: int
    padding: str                 # "longest" or "max_length"
    padding_side: str = "right"
    truncation: bool = True
    append_newline: bool = True  # a NewLineTaskProcessorStep precedes the tokenizer

    def __post_init__(self) -> None:
        if self.padding not in ("longest", "max_length"):
            raise ConfigError(f"tokenizer_processor padding = {self.padding!r}: capsule_ros reproduces 'longest' "
                              "and 'max_length'")
        if self.padding_side != "right":
            raise ConfigError(f"tokenizer_processor padding_side = {self.padding_side!r}: only 'right' is supported")
        if not self.truncation:
            raise ConfigError("tokenizer_processor truncation = false: a task longer than max_length would change "
                              "the buffer's length; only truncation = true is supported")
        if self.max_length < 1:
            raise ConfigError(f"tokenizer_processor max_length = {self.max_length}: must be positive")

    def describe(self) -> dict:
        return asdict(self)


def tokenizer_options(checkpoint, newline_step: str) -> TokenizerOptions:
    """The tokenizer step of the checkpoint's ``policy_preprocessor.json`` (LeRobot's
    TokenizerProcessorStep); ``newline_step``: the registry name of the kind's step that
    appends the newline (SmolVLA's ``NEWLINE_STEP``, π0's ``pi0_new_line_processor``), which
    sets ``append_newline`` when it precedes the tokenizer."""
    steps = processor_steps(checkpoint, PREPROCESSOR_FILE)
    names = [str(step.get("registry_name")) for step in steps]
    where = checkpoint.directory / PREPROCESSOR_FILE
    if names.count(TOKENIZER_STEP) != 1:
        raise ConfigError(f"{where}: expected one {TOKENIZER_STEP!r} step, found {names.count(TOKENIZER_STEP)}")
    index = names.index(TOKENIZER_STEP)
    config = steps[index].get("config") or {}
    if config.get("task_key", "task") != "task":
        raise ConfigError(f"{where}: {TOKENIZER_STEP} reads task_key {config.get('task_key')!r}; only 'task' is "
                          "supported")
    newline = newline_step in names[:index]
    if newline_step in names[index:]:
        raise ConfigError(f"{where}: {newline_step!r} after the tokenizer step is not supported")
    try:
        return TokenizerOptions(max_length=int(config.get("max_length", 512)),
                                padding=str(config.get("padding", "max_length")),
                                padding_side=str(config.get("padding_side", "right")),
                                truncation=bool(config.get("truncation", True)), append_newline=newline)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_tokenizer(directory: Path, where: str):
    """``AutoTokenizer`` of the files in ``directory``, offline; ConfigError in one line when
    there is none (``where`` says who asked)."""
    from transformers import AutoTokenizer  # the VLA kinds only: transformers is a heavy import
    if not directory.is_dir():
        raise ConfigError(f"{where}: {directory} is not a directory")
    present = [name for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
               if (directory / name).is_file()]
    if not present:
        raise ConfigError(f"{where}: {directory} holds no tokenizer (tokenizer.json, tokenizer_config.json or "
                          "tokenizer.model): stage the VLM's tokenizer files there (docs/vla.md)")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad directory: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: the tokenizer in {directory} does not load ({type(exc).__name__}: "
                          f"{first})") from None


class TaskTokenizer:
    """A task string -> the token buffer (module docstring). ``prompt``: how the task string
    is turned into the tokenizer's text before the newline rule (the identity for SmolVLA)."""

    def __init__(self, tokenizer, options: TokenizerOptions, embedding_rows: int, where: str,
                 prompt: Optional[Callable[[str], str]] = None):
        self.tokenizer, self.options = tokenizer, options
        self.prompt = prompt or (lambda task: task)
        size = len(tokenizer)
        largest = max(tokenizer.get_vocab().values(), default=-1)
        if size > embedding_rows or largest >= embedding_rows:
            raise ConfigError(f"{where}: the tokenizer has {size} tokens but the text embedding has {embedding_rows} "
                              f"rows (its largest token id is {largest}): it is not this checkpoint's tokenizer")
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
        try:
            self.encode("")
        except Exception as exc:  # noqa: BLE001 - e.g. max_length padding without a pad token: one line
            raise ConfigError(f"{where}: the tokenizer cannot encode a task as the checkpoint asks "
                              f"({type(exc).__name__}: {exc})") from None

    @property
    def max_length(self) -> int:
        return self.options.max_length

    def text_of(self, task: str) -> str:
        """The text the tokenizer sees: the prompt, with LeRobot's newline rule."""
        text = self.prompt(task)
        if self.options.append_newline and not text.endswith("\n"):
            text = f"{text}\n"
        return text

    def encode(self, task: str) -> np.ndarray:
        """int64 [2, max_length]: token ids and attention mask of ``task``."""
        o = self.options
        encoded = self.tokenizer([self.text_of(task)], max_length=o.max_length, truncation=o.truncation,
                                 padding=o.padding, padding_side=o.padding_side, return_tensors="np")
        ids = np.asarray(encoded["input_ids"], dtype=np.int64)[0]
        mask = np.asarray(encoded["attention_mask"], dtype=np.int64)[0]
        out = np.zeros((2, o.max_length), np.int64)
        out[TOKENS] = self.pad_id
        out[TOKENS, :ids.size] = ids
        out[MASK, :mask.size] = mask
        return out

    def describe(self) -> dict:
        """What changes the token buffer (part of the architecture): the options and the vocabulary."""
        return {**self.options.describe(), "vocabulary": len(self.tokenizer),
                "tokenizer": type(self.tokenizer).__name__}
