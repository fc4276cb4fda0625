"""π0 / π0.5's prompts, as LeRobot 0.6.1's preprocessors build them before tokenising.

- π0 (``lerobot/policies/pi0/processor_pi0.py``): ``Pi0NewLineProcessor`` appends ``"\\n"`` unless the task
  ends with one; the prompt is the task alone (an absent or empty task is ``""``, as
  ``prepare_observation_for_inference`` sets it, so the prompt is ``"\\n"``). The shared
  ``TaskTokenizer`` does exactly that (``append_newline``).
- π0.5 (``lerobot/policies/pi05/processor_pi05.py``, ``Pi05PrepareStateTokenizerProcessorStep``, after the
  normaliser): the normalised state is discretised into 256 bins over [-1, 1]
  (``np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1``: -1 below, 255 above) and the
  prompt is ``f"Task: {cleaned}, State: {' '.join(bins)};\\nAction: "`` with
  ``cleaned = task.strip().replace("_", " ").replace("\\n", " ")``: ``state_prompt``, with
  LeRobot's own expressions (Python's ``str`` of each numpy int64 bin).

Then LeRobot's ``TokenizerProcessorStep`` tokenises the prompt with the checkpoint's
tokenizer (``TaskTokenizer.encode``, the same library and call, so the ids are LeRobot's).
"""
from __future__ import annotations

import numpy as np

STATE_BINS = np.linspace(-1, 1, 256 + 1)[:-1]


def clean_task(task: str) -> str:
    """π0.5's cleaning of the task before it enters the prompt."""
    return (task or "").strip().replace("_", " ").replace("\n", " ")


def state_prompt(task: str, normalized_state: np.ndarray) -> str:
    """π0.5's prompt for ``task`` and the normalised state (float32 [n])."""
    discretized = np.digitize(np.asarray(normalized_state)[None], bins=STATE_BINS) - 1
    state_str = " ".join(map(str, discretized[0]))
    return f"Task: {clean_task(task)}, State: {state_str};\nAction: "
