"""The CPU numerics level: which vector code paths torch's CPU kernels may take, pinned
so that a recording made on one machine verifies bit for bit on another.

Why. The same torch build computes different last bits on CPUs of different vector ISAs:
ATen dispatches each kernel to its AVX512, AVX2 or baseline variant (vector width
changes the order of a reduction's sums), MKL's GEMM picks a code path per CPU, oneDNN
JIT-compiles for the widest ISA it finds, and a reduction split over N threads sums in N
parts. A bag recorded on an AVX2 robot then diverges in the last bit on an AVX512 CI
machine (up to 6.6e-7 for the default policy), although nothing is wrong.

A *level* caps all of them at once, with each library's own switch:

| level | ATen (``ATEN_CPU_CAPABILITY``) | MKL (``MKL_CBWR``) | oneDNN (``ONEDNN_MAX_CPU_ISA``) | CPU needs |
| --- | --- | --- | --- | --- |
| ``baseline`` | ``default`` | ``COMPATIBLE,STRICT`` | ``SSE41`` | SSE4.2 (every x86-64 since 2008) |
| ``avx2`` | ``avx2`` | ``AVX2,STRICT`` | ``AVX2`` | AVX2 + FMA (Intel 2013+, AMD 2015+) |
| ``avx512`` | ``avx512`` | ``AVX512,STRICT`` | ``AVX512_CORE`` | AVX512 F/BW/DQ/VL |

MKL's conditional numerical reproducibility (CNR) with ``STRICT`` gives the same bits on
any CPU that has the branch, whatever the alignment of the data. The intra-op thread
count is the other half: ``runtime.cpu_threads`` is part of the recorded configuration
and must be a fixed number (not 0, "the machine's core count") under a pinned level.

``runtime.numerics`` chooses: ``portable`` (the default: ``avx2`` on x86-64, which every
x86 machine of a deployment has in practice; ``native`` on other architectures, where no
level is implemented), ``native`` (no pin: the fastest code paths this machine has, and
whatever the environment already sets), or a level by name. Bags and capsules record the
level they were made at (``recorded_level``); ``capsule-ros replay`` sets the bag's level,
or refuses with the reason when this machine lacks it.

When. Each library reads its switch once, at its first use (ATen at the first kernel
dispatch, MKL at the first GEMM, oneDNN at its first primitive), and keeps it for the
life of the process. ``pin`` therefore runs before a process builds its first policy
(``serving.factory.build_policy``, the ``capsule-ros`` command line, the test suite's
conftest), and again where a runtime is made (``engine.configure_torch``), where it also
checks that the level holds: a process whose torch already ran at another level is
refused (NumericsUnavailable) with what to do, never served at a level other than the
one it records. Changing the level needs a new process.

This module imports torch only inside functions, so it can run before torch is loaded.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Optional

from capsule_ros.errors import ConfigError

NATIVE = "native"
PORTABLE = "portable"
ENV_ATEN, ENV_MKL, ENV_ONEDNN = "ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"
PIN_VARIABLES = (ENV_ATEN, ENV_MKL, ENV_ONEDNN)        # what ``pin`` sets (children inherit it)
X86_MACHINES = ("x86_64", "amd64")
# runtime.float32_matmul, a GPU's float32 products (engine.configure_torch sets them):
# torch.set_float32_matmul_precision's names for the two a GPU tells apart
FLOAT32_MATMUL_HIGHEST, FLOAT32_MATMUL_HIGH = "highest", "high"
FLOAT32_MATMUL_CHOICES = (FLOAT32_MATMUL_HIGHEST, FLOAT32_MATMUL_HIGH)


class NumericsUnavailable(ConfigError):
    """The requested numerics level cannot hold in this process: the CPU lacks its
    instructions, or torch already runs at another level."""


@dataclass(frozen=True)
class Level:
    """One pinned level: the value of each library's switch and the CPU flags it needs
    (names as in /proc/cpuinfo)."""

    name: str
    aten: str
    mkl: str
    onednn: str
    cpu_flags: FrozenSet[str]

    def environment(self) -> Dict[str, str]:
        return {ENV_ATEN: self.aten, ENV_MKL: self.mkl, ENV_ONEDNN: self.onednn}


LEVELS: Dict[str, Level] = {level.name: level for level in (
    Level("baseline", "default", "COMPATIBLE,STRICT", "SSE41", frozenset({"sse4_1", "sse4_2"})),
    Level("avx2", "avx2", "AVX2,STRICT", "AVX2", frozenset({"avx2", "fma"})),
    Level("avx512", "avx512", "AVX512,STRICT", "AVX512_CORE",
          frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"})),
)}
CHOICES = (PORTABLE, NATIVE, *LEVELS)            # the values of runtime.numerics
SETTING_DOC = ("CPU numerics level, so recordings verify bit for bit on other machines: portable (avx2 on "
               "x86-64), native (no pin: this machine's fastest code paths), baseline, avx2 or avx512 "
               "(docs/rosbag-replay.md#portable-recordings)")


def resolve(setting: str, machine: Optional[str] = None) -> str:
    """The level a ``runtime.numerics`` value means on this machine (``portable`` ->
    ``avx2`` on x86-64, ``native`` elsewhere); ConfigError for an unknown value."""
    if setting not in CHOICES:
        raise ConfigError(f"runtime.numerics = {setting!r}: must be one of {list(CHOICES)}")
    if setting != PORTABLE:
        return setting
    return "avx2" if _is_x86(machine) else NATIVE


def check_threads(setting: str, cpu_threads: int) -> None:
    """A pinned level needs a fixed intra-op thread count (reductions split by it)."""
    if cpu_threads == 0 and resolve(setting) != NATIVE:
        raise ConfigError(f"runtime.cpu_threads = 0 (torch's default: the machine's core count) with "
                          f"runtime.numerics = {setting!r}: a reduction's sums depend on the thread count, so "
                          "another machine would compute other bits; set a fixed count (the default is 1) or "
                          "runtime.numerics: native")


def cpu_flags() -> FrozenSet[str]:
    """This CPU's feature flags (from /proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def missing_flags(level: str, flags: FrozenSet[str], machine: Optional[str] = None) -> str:
    """Why a CPU with ``flags`` cannot run ``level`` ('' when it can)."""
    if level == NATIVE:
        return ""
    if not _is_x86(machine):
        return f"this is a {machine or platform.machine()} machine; level {level!r} is an x86-64 level"
    lacking = sorted(LEVELS[level].cpu_flags - flags)
    return f"this CPU lacks {', '.join(lacking)}" if lacking else ""


def pin(setting: str, cpu_threads: Optional[int] = None) -> str:
    """Pin this process's CPU numerics to ``setting`` (``native``: leave them as they are)
    and return the resolved level. Checks that it holds (module docstring): raises
    NumericsUnavailable when the CPU lacks the level or torch already runs at another,
    ConfigError for a bad value or a thread count of 0 under a pinned level."""
    level = resolve(setting)
    if cpu_threads is not None:
        check_threads(setting, cpu_threads)
    if level == NATIVE:
        return level
    why = missing_flags(level, cpu_flags())
    if why:
        raise NumericsUnavailable(f"runtime.numerics = {setting!r} (level {level}): {why}; choose a level every "
                                  f"machine of the deployment has ({', '.join(LEVELS)}) or native")
    os.environ.update(LEVELS[level].environment())
    import torch
    running = str(torch.backends.cpu.get_cpu_capability()).lower()    # fixed from here on, for the process
    if running != LEVELS[level].aten:
        raise NumericsUnavailable(
            f"runtime.numerics = {setting!r} (level {level}), but torch in this process already runs its CPU "
            f"kernels at {running.upper()}: the level is fixed at torch's first operation. Start a new process "
            f"(policy_node and capsule-ros set it in time), or call capsule_ros.runtime.numerics.pin({level!r}) "
            "before using torch")
    return level


def recorded_level(setting: str) -> str:
    """What bags and capsules record for a runtime made with ``setting``: the resolved
    level (``avx2``), or ``native-<ATen capability>`` (``native-avx512``) without a pin."""
    level = resolve(setting)
    if level != NATIVE:
        return level
    import torch
    return f"{NATIVE}-{str(torch.backends.cpu.get_cpu_capability()).lower()}"


def replay_setting(recorded: str) -> str:
    """The ``runtime.numerics`` a replay of something recorded at ``recorded`` runs with:
    the same level, or native for a native recording (or one that names none); a
    ConfigError for a level this build does not know (a newer one, another architecture's)."""
    if recorded in LEVELS:
        return recorded
    if recorded == "" or recorded == NATIVE or recorded.startswith(NATIVE + "-"):
        return NATIVE
    raise ConfigError(f"numerics level {recorded!r} is unknown to this build (it knows {', '.join(LEVELS)} and "
                      "native)")


def _is_x86(machine: Optional[str]) -> bool:
    return (machine or platform.machine()).lower() in X86_MACHINES
