"""The π0 / π0.5 fixtures (test/fixtures/lerobot/pi0, pi05, pi0_bf16, made by
tools/lerobot_fixtures/make_pi_fixtures.py with LeRobot 0.6.1) as the tests use them: the
unpacked checkpoint, the shared PaliGemma-format tokenizer, the recorded inputs (cameras,
joint states, the task of every step) and LeRobot's actions; the rest is what every VLA
fixture shares (``vla_fixtures.RecordedVLA``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lerobot_fixtures import FIXTURES, extract_checkpoint
from vla_fixtures import TASK_PORT, RecordedVLA, port_of

from capsule_ros.policies.vla.rtc import RTCSettings

NAMES = ["pi0", "pi05", "pi0_bf16"]
TOKENIZER = FIXTURES / "paligemma_tokenizer"


@dataclass
class PiFixture(RecordedVLA):
    """A π0 / π0.5 fixture: its checkpoint unpacked, the shared tokenizer; the tasks are
    recorded as text."""

    checkpoint_dir: Path = Path()
    tokenizer: Path = TOKENIZER

    @classmethod
    def load(cls, name: str, root: Path) -> PiFixture:
        return cls(name, *cls.recorded(name), json.loads((FIXTURES / name / "meta.json").read_text()),
                   checkpoint_dir=extract_checkpoint(FIXTURES / name / "pretrained_model.tar.xz", root / name))

    @property  # type: ignore[override] - π0 or π0.5, by the checkpoint
    def kind(self) -> str:
        return "lerobot_pi05" if self.meta["policy"] == "pi05" else "lerobot_pi0"

    @property
    def checkpoint(self) -> Path:
        return self.checkpoint_dir

    @property
    def vlm_files(self) -> Path:
        return self.tokenizer

    @property
    def token_length(self) -> int:
        return 200 if self.meta["policy"] == "pi05" else 48

    def task(self, episode: int, step: int) -> str:
        return str(self.inputs["task"][episode, step])

    def rtc_settings(self) -> RTCSettings:
        """The guided RTC settings the fixture's references were recorded with."""
        r = self.meta["rtc"]
        return RTCSettings("guided", r["max_guidance_weight"], r["prefix_attention_schedule"].split(".")[-1],
                           r["execution_horizon"])


__all__ = ["NAMES", "TASK_PORT", "TOKENIZER", "PiFixture", "port_of"]
