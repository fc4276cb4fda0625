"""Portable recordings: the CPU numerics level (``runtime.numerics``) is pinned before torch
runs, recorded in bags and capsules, and set again by the replayer, so a bag recorded on
one vector ISA verifies bit for bit on another.

On one machine: a bag recorded without a pin (this machine's native ISA) and one recorded
at the pinned level are both verified by ``capsule-ros replay`` in a process whose native
level is another one (``ANOTHER_LEVEL``: the environment of a CPU without AVX2, as far as
torch, MKL and oneDNN are concerned). The pinned bag is bit-identical, the native one
diverges.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import DEFAULT_PARAMS, REPO, ClientNode

from capsule_ros.errors import ConfigError
from capsule_ros.runtime import numerics
from capsule_ros.runtime.engine import RuntimeConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PINS = (numerics.ENV_ATEN, numerics.ENV_MKL, numerics.ENV_ONEDNN)
ANOTHER_LEVEL = {numerics.ENV_ATEN: "default", numerics.ENV_MKL: "COMPATIBLE", numerics.ENV_ONEDNN: "SSE41"}
AVX2_CPU = frozenset({"fpu", "sse", "sse2", "sse4_1", "sse4_2", "avx", "avx2", "fma", "bmi2"})   # a Haswell PC
CLI = [sys.executable, "-m", "capsule_ros.cli.main"]


def environment(**pins: str) -> dict:
    """This process's environment without its numerics pins (the suite pins its own), plus ``pins``."""
    env = {k: v for k, v in os.environ.items() if k not in PINS}
    env.update(pins)
    return env


def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=REPO)


# -- the levels, without torch ------------------------------------------------------------------------

def test_a_level_names_what_a_cpu_needs_and_portable_is_avx2_on_x86():
    assert numerics.resolve("portable", machine="x86_64") == "avx2"
    assert numerics.resolve("portable", machine="aarch64") == "native"
    assert numerics.missing_flags("avx2", AVX2_CPU, machine="x86_64") == ""
    assert numerics.missing_flags("avx512", AVX2_CPU, machine="x86_64") == \
        "this CPU lacks avx512bw, avx512dq, avx512f, avx512vl"
    assert "aarch64 machine" in numerics.missing_flags("avx2", AVX2_CPU, machine="aarch64")
    assert numerics.missing_flags("native", frozenset(), machine="aarch64") == ""
    with pytest.raises(ConfigError, match=r"runtime.numerics = 'avx3': must be one of"):
        numerics.resolve("avx3")
    with pytest.raises(ConfigError, match="unknown to this build"):
        numerics.replay_setting("sve256")
    assert numerics.replay_setting("native-avx512") == numerics.replay_setting("") == "native"


def test_a_pinned_level_needs_a_fixed_thread_count():
    with pytest.raises(ConfigError, match=r"runtime.cpu_threads = 0 .* reduction"):
        RuntimeConfig(numerics="portable", cpu_threads=0)
    with pytest.raises(ConfigError, match="must be one of"):
        RuntimeConfig.from_mapping({"numerics": "fastest"})
    assert RuntimeConfig(numerics="native", cpu_threads=0).cpu_threads == 0
    assert RuntimeConfig().numerics == "portable" and RuntimeConfig().cpu_threads == 1


# -- pinning a process --------------------------------------------------------------------------------

def test_a_process_pins_its_level_before_torch_runs_and_is_refused_after():
    pinned = python("import os; from capsule_ros.runtime import numerics; print(numerics.pin('baseline'));"
                    "import torch; print(torch.backends.cpu.get_cpu_capability(), os.environ['MKL_CBWR'])",
                    environment())
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split() == ["baseline", "DEFAULT", "COMPATIBLE,STRICT"]
    late = python("import torch; torch.ones(3).sum();"
                  "from capsule_ros.runtime import numerics; numerics.pin('baseline')", environment())
    assert late.returncode != 0
    assert "NumericsUnavailable" in late.stderr and "already runs its CPU kernels at" in late.stderr
    assert "Start a new process" in late.stderr


def test_a_runtime_records_its_level_and_refuses_one_that_does_not_hold():
    """Through the serving factory (what the node's configure runs), in fresh processes."""
    code = ("import dataclasses, sys; from pathlib import Path;"
            "from capsule_ros.serving.config import ServingConfig;"
            "from capsule_ros.serving.factory import build_runtime;"
            "c = ServingConfig.from_file(Path('config/policy.yaml'));"
            "c = dataclasses.replace(c, policy=dataclasses.replace(c.policy, weights=''),"
            " runtime=dataclasses.replace(c.runtime, device='cpu', numerics=sys.argv[-1]));"
            "print(build_runtime(c).numerics)")
    for level, expected in (("portable", "avx2"), ("baseline", "baseline"), ("avx2", "avx2")):
        done = subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=environment())
        assert done.returncode == 0 and done.stdout.split()[-1] == expected, (level, done.stderr[-2000:])
    native = subprocess.run([sys.executable, "-c", code, "native"], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env=environment(**ANOTHER_LEVEL))
    assert native.stdout.split()[-1] == "native-default", native.stderr[-2000:]    # what the environment says


# -- recorded in capsules ----------------------------------------------------------------------------

def test_capsule_files_record_the_level_and_older_files_still_read(tmp_path):
    import hashlib

    import torch

    from capsule_ros.capsules.directory import CapsuleDirectory
    from capsule_ros.capsules.fileformat import CapsuleHeader, read_header, write_capsule
    from capsule_ros.capsules.store import Capsule
    from capsule_ros.errors import InvalidArgument
    from capsule_ros.runtime.arena import ArenaLayout, BufferKind, buffer_specs
    layout = ArenaLayout(buffer_specs([("rec", (16,), torch.float32, BufferKind.RECURRENT)]))
    fingerprint = hashlib.sha256(b"graph").hexdigest()
    directory = CapsuleDirectory(tmp_path / "caps", max_file_bytes=1 << 20)
    capsule = Capsule("e1.s3.abcdef", "x", "", 1, 3, layout.nbytes, fingerprint, 1, numerics="avx2")
    directory.save(capsule, bytes(layout.nbytes), layout.schema())
    assert directory.header("e1.s3.abcdef").numerics == "avx2"
    loaded, _ = directory.load("e1.s3.abcdef", expected_fingerprint=fingerprint)
    assert loaded.numerics == "avx2"
    older = CapsuleHeader("e1.s4.abcdef", "", "", 1, 4, 1, layout.nbytes, fingerprint, layout.schema())
    with open(tmp_path / "caps" / "e1.s4.abcdef.capsule", "wb") as f:
        write_capsule(f, older, bytes(layout.nbytes), None)        # a file from before the field: no key at all
    assert "numerics" not in older.to_json() and directory.describe("e1.s4.abcdef").numerics == ""
    with pytest.raises(InvalidArgument, match="numerics"), open(tmp_path / "bad.capsule", "wb") as f:
        write_capsule(f, CapsuleHeader("e1.s5.abcdef", "", "", 1, 5, 1, layout.nbytes, fingerprint, layout.schema(),
                                       numerics="AVX2; rm"), bytes(layout.nbytes), None)
    assert read_header(FIXTURES / "capsules" / next(p.name for p in (FIXTURES / "capsules").iterdir()),
                       max_bytes=1 << 24).numerics == "avx2"


# -- recorded in bags, set again by the replayer ------------------------------------------------------

def record(tmp_path: Path, rclpy_context, tag: str, numerics_setting: str, env: dict) -> dict:
    """The rollback scenario of the fixture bags through a policy_node at ``numerics_setting``."""
    from fixtures.make_bags import NODE_PARAMS, Driver, record_rollback

    from capsule_ros.ros import processes
    namespace = f"/num_{tag}{os.getpid() % 10000}"
    params = {**NODE_PARAMS, "runtime": {"numerics": numerics_setting},
              "capsules": {"directory": str(tmp_path / f"{tag}-capsules")}}
    proc = processes.start_policy_node(tmp_path, params, namespace=namespace, params_file=DEFAULT_PARAMS, tag=tag,
                                       env=env)
    client = ClientNode(rclpy_context, f"numerics_{tag}_client", node_path=f"{namespace}/capsule_policy")
    try:
        info = record_rollback(Driver(client, namespace), tmp_path / f"{tag}-bag", "mcap")
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()
    info["capsules"] = tmp_path / f"{tag}-capsules"
    return info


def replay(bag, env: dict, *extra) -> tuple:
    done = subprocess.run([*CLI, "replay", str(bag), "--verify", "--json", *extra], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    return done.returncode, (json.loads(done.stdout) if done.stdout.strip() else {}), done.stderr


@pytest.mark.ros
def test_pinned_recording_verifies_at_another_level_and_a_native_one_diverges(tmp_path, rclpy_context):
    here = python("import torch; print(torch.backends.cpu.get_cpu_capability())", environment()).stdout.strip()
    assert here.lower() != ANOTHER_LEVEL[numerics.ENV_ATEN], "this machine itself is at the other level"
    native = record(tmp_path, rclpy_context, "native", "native", environment())
    pinned = record(tmp_path, rclpy_context, "pinned", "avx2", environment())
    from capsule_ros.bag.reader import Recording
    with Recording(native["bag"]) as a, Recording(pinned["bag"]) as b:
        assert a.meta.numerics == f"native-{here.lower()}" and b.meta.numerics == "avx2"
    from capsule_ros.capsules.fileformat import read_header
    saved = {tag: read_header(next(info["capsules"].rglob(f"{info['capsule_id']}.capsule")), max_bytes=1 << 24)
             for tag, info in (("native", native), ("pinned", pinned))}
    assert (saved["native"].numerics, saved["pinned"].numerics) == (f"native-{here.lower()}", "avx2")

    elsewhere = environment(**ANOTHER_LEVEL)                   # a machine of another vector ISA
    code, verdict, err = replay(pinned["bag"], elsewhere)
    assert code == 0 and verdict["identical"] and verdict["complete"], (err, verdict.get("first_divergence"))
    assert (verdict["numerics_recorded"], verdict["numerics_replay"]) == ("avx2", "avx2")
    assert verdict["steps_compared"] == pinned["steps"]

    code, verdict, err = replay(native["bag"], elsewhere)
    assert code == 1 and verdict["first_divergence"]["what"] in ("values/chunk", "values", "chunk"), (err, verdict)
    assert verdict["numerics_replay"] == "native-default"
    assert any("without a CPU numerics pin" in note for note in verdict["notes"]), verdict["notes"]

    code, verdict, err = replay(native["bag"], environment())   # the native bag on its own ISA: identical
    assert code == 0 and verdict["identical"], (err, verdict.get("first_divergence"))


def test_a_bag_at_a_level_this_build_does_not_know_is_refused(tmp_path):
    bag = tmp_path / "arm_bag"
    shutil.copytree(FIXTURES / "rollback_mcap", bag)
    meta = yaml.safe_load((bag / "metadata.yaml").read_text())
    meta["rosbag2_bagfile_information"]["custom_data"]["capsule_ros.numerics"] = "sve256"
    (bag / "metadata.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    code, _, err = replay(bag, environment())
    assert code == 2
    assert "recorded at CPU numerics level sve256" in err and "unknown to this build" in err and "Traceback" not in err
