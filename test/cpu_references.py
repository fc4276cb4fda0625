"""Which recorded bits a test compares with on this CPU.

A pinned CPU numerics level caps each library's code path, but two CPUs can still compute
other bits at it (docs/rosbag-replay.md, "What it does not cover"). Recorded references
(LeRobot's actions, the fixture bags) can therefore come in sets per CPU class: the set
made on a CPU of this one's class where there is one, else the set committed first."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from capsule_ros.runtime import numerics

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@functools.lru_cache(maxsize=1)
def cpu_class() -> str:
    """``<level>-<16 hex digits>``: what this CPU's kernels compute at the suite's pinned
    numerics level. Seeded inputs go through the kinds of kernels the fixtures' policies
    run, one thread, and their output bytes are hashed: GEMMs and batched GEMMs (MKL),
    convolutions of the fixtures' shapes (oneDNN), vectorised math, norms and softmax.

    Bits recorded on a CPU of one class are the reference on every CPU of that class."""
    level = numerics.pin(numerics.PORTABLE)
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    fn = torch.nn.functional
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            x = r(4096)
            outs = [r(37, 300) @ r(300, 129), r(5, 2048) @ r(2048, 512), torch.bmm(r(4, 50, 64), r(4, 64, 50)),
                    fn.conv2d(r(1, 3, 96, 128), r(64, 3, 7, 7), stride=2, padding=3),      # a ResNet's stem
                    fn.conv2d(r(1, 64, 24, 32), r(64, 64, 3, 3), padding=1),                # its 3x3 blocks
                    fn.conv2d(r(1, 128, 12, 16), r(256, 128, 3, 3), stride=2, padding=1),
                    fn.conv2d(r(1, 256, 6, 8), r(512, 256, 1, 1)),
                    fn.conv1d(r(1, 64, 16), r(128, 64, 5), padding=2),                      # a 1-D U-Net
                    fn.conv2d(r(1, 3, 64, 64), r(96, 3, 16, 16), stride=16),                # a ViT's patches
                    torch.exp(x), torch.sin(x), torch.cos(x), torch.tanh(x), fn.gelu(x, approximate="tanh"),
                    fn.mish(x), fn.silu(x), torch.rsqrt(x.abs() + 1), torch.softmax(x.view(64, 64), -1),
                    fn.layer_norm(x.view(16, 256), (256,)), fn.group_norm(x.view(1, 32, 128), 8)]
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for out in outs:
        digest.update(out.contiguous().numpy().tobytes())
    return f"{level}-{digest.hexdigest()[:16]}"


def recorded(directory: Path, name: str) -> Path:
    """``directory / name``, or the same recording made on a CPU of this one's class,
    ``directory / "cpu" / cpu_class() / name``, where there is one. A CPU of a class without
    recordings of its own is compared with the committed ones, and fails where its bits
    differ."""
    mine = directory / "cpu" / cpu_class() / name
    return mine if mine.exists() else directory / name


def bag_fixtures() -> Path:
    """The directory of the fixture bags (``rollback_mcap``, ``events_sqlite3``, their
    ``capsules`` and ``manifest.json``; test/fixtures/make_bags.py) for this CPU's class."""
    return recorded(FIXTURES, "manifest.json").parent
