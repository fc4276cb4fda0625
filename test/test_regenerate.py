"""`capsule-ros check` and `capsule-ros regenerate` on capsule directories written by real
sessions of the default policy (its shape, weights saved to a file), through the installed
executable where exit codes and signals matter.

- Perturbed weights: regenerate (exit 0, drift reported), then a session of the new
  weights re-enters each regenerated capsule: its state, and the actions after it, equal
  the new model run from reset over the same inputs, bit for bit (also for a capsule whose
  recipe starts from another capsule). SRC's files are unchanged, bytes and mtimes.
- Drift over ``--max-drift``: exit 1, with the first step over it.
- A capsule without a recipe (saved with recipes off; a format version 1 file): exit 2
  with its reason, the others regenerated.
- ``check`` names the cause: weights; architecture (and weights); port mapping (which
  also makes the recipe's rows unusable: the capsule would be lost, exit 2); a version 1
  file's cause cannot be split.
- kill -9 during ``regenerate`` leaves DST absent; the next run completes it. A DST that
  exists and is not empty, or lies inside SRC, is refused (exit 3), nothing written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Dict, NamedTuple, Tuple

import pytest
import torch
import yaml
from harness import deep_merge
from runtime_fixtures import default_config, feed, observations

from capsule_ros.cli import check_cmd, regenerate_cmd
from capsule_ros.config import load_params_file
from capsule_ros.runtime.weights import save_weights
from capsule_ros.serving.factory import build_policy, build_session

REPO = Path(__file__).resolve().parents[1]
V1_FIXTURE = next((REPO / "test" / "fixtures" / "capsules").glob("*.capsule"))
OBS = observations(80, seed=31)


class Made(NamedTuple):
    """A capsule directory of the old weights and what the tests need around it."""

    src: Path
    ids: Dict[str, str]                # c1 (step 30), c2 (step 50), c3 (episode 2 from c1, step 50)
    config: Any                        # the old deployment's ServingConfig
    new_weights: Path
    tmp: Path


def with_weights(config, weights: Path, directory: Path):
    return dataclasses.replace(config, policy=dataclasses.replace(config.policy, weights=str(weights)),
                               capsules=dataclasses.replace(config.capsules, directory=str(directory)))


def params_file(path: Path, weights: Path, extra: Dict[str, Any] = None) -> Path:
    """config/policy.yaml on the CPU with these weights (and ``extra`` merged in)."""
    params = load_params_file(REPO / "config" / "policy.yaml")
    params = deep_merge(params, {"policy": {"weights": str(weights)}, "runtime": {"device": "cpu"},
                                 "control": {"deadline_ms": 0.0}, **(extra or {})})
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    return path


def files(directory: Path) -> Dict[str, Tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def cli(*args) -> subprocess.CompletedProcess:
    """The installed `capsule-ros` (PATH from scripts/env.sh)."""
    return subprocess.run(["capsule-ros", *map(str, args)], capture_output=True, text=True, timeout=600)


def arena(session) -> bytes:
    return bytes(session.parts.runtime.arena.storage.numpy())


def bits(records) -> list:
    return [r.values.tobytes() for r in records]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Made:
    tmp = tmp_path_factory.mktemp("regenerate")
    config = default_config(tmp)
    policy = build_policy(config)
    old, new = tmp / "old.safetensors", tmp / "new.safetensors"
    save_weights(old, policy.state_dict())
    noise = torch.Generator().manual_seed(7)
    save_weights(new, {k: v + 1e-3 * torch.randn(v.shape, generator=noise) for k, v in policy.state_dict().items()})
    config = with_weights(config, old, tmp / "capsules")
    session = build_session(config)
    feed(session, OBS[:30])
    c1 = session.verbs.commit("c1", persist=True)
    feed(session, OBS[30:50])
    c2 = session.verbs.commit("c2", persist=True)
    session.verbs.reset(c1.id)
    feed(session, OBS[50:70])
    c3 = session.verbs.commit("c3", persist=True)
    session.release()
    return Made(tmp / "capsules", {"c1": c1.id, "c2": c2.id, "c3": c3.id}, config, new, tmp)


def test_perturbed_weights_regenerated_capsules_act_as_the_new_model_from_reset(made, tmp_path):
    before = files(made.src)
    dst = tmp_path / "dst"
    result = cli("regenerate", made.src, "--params", params_file(tmp_path / "new.yaml", made.new_weights),
                 "--out", dst, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["regenerated"], report["skipped"], report["exit"]) == (3, 0, 0), report
    assert all(0 < row["drift"] < 1 for row in report["capsules"]), report     # the new model acts otherwise
    assert files(made.src) == before, "SRC was touched"
    assert sorted(p.name for p in dst.iterdir()) == sorted(f"{i}.capsule" for i in made.ids.values())

    new = with_weights(made.config, made.new_weights, dst)
    served = build_session(new)
    reference = build_session(with_weights(made.config, made.new_weights, tmp_path / "reference"))
    feed(reference, OBS[:50])                              # the new model from reset, c2's inputs
    result = served.verbs.reenter(made.ids["c2"])
    assert not result.fallback and arena(served) == arena(reference)
    assert bits(feed(served, OBS[70:80])) == bits(feed(reference, OBS[70:80]))

    reference = build_session(with_weights(made.config, made.new_weights, tmp_path / "reference2"))
    feed(reference, OBS[:30])
    root = reference.verbs.commit("new c1")
    reference.verbs.reset(root.id)                               # episode 2 from it, as c3 was made
    feed(reference, OBS[50:70])
    served.verbs.reenter(made.ids["c3"])
    assert arena(served) == arena(reference), "the capsule rooted at c1 is not the new model's"
    assert bits(feed(served, OBS[70:80])) == bits(feed(reference, OBS[70:80]))
    header = served.parts.directory.header(made.ids["c3"])
    assert header.recipe.root.capsule_id == made.ids["c1"] and header.recipe.root.fingerprint == header.fingerprint
    shown = json.loads(cli("inspect", dst / f"{made.ids['c3']}.capsule", "--json").stdout)
    assert shown["valid"] and shown["header"]["regenerable"] and shown["header"]["format_version"] == 2
    assert shown["header"]["recipe_bytes"] == header.recipe.nbytes > 20 * 264


def test_drift_over_the_bound_exits_1_with_the_first_step_over_it(made, tmp_path):
    new = params_file(tmp_path / "new.yaml", made.new_weights)
    result = cli("regenerate", made.src, "--params", new, "--out", tmp_path / "dst", "--max-drift", "1e-6", "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert sorted(report["over_bound"]) == sorted(made.ids.values()) and report["exit"] == 1
    first = {row["id"]: row["first_step_over"] for row in report["capsules"]}
    assert 1 <= first[made.ids["c1"]] <= 30 and 31 <= first[made.ids["c3"]] <= 50, first
    assert (tmp_path / "dst").is_dir()                     # written all the same: the gate is the exit status


def test_capsules_without_a_recipe_exit_2_with_their_reason(made, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(made.src, src)
    shutil.copy(V1_FIXTURE, src / V1_FIXTURE.name)         # format version 1: no recipe
    plain = dataclasses.replace(made.config, capsules=dataclasses.replace(made.config.capsules, recipe=False,
                                                                         directory=str(tmp_path / "off")))
    session = build_session(plain)
    feed(session, OBS[:5])
    off = session.verbs.commit("no recipe", persist=True)
    session.release()
    shutil.copy(tmp_path / "off" / f"{off.id}.capsule", src)
    result = cli("regenerate", src, "--params", params_file(tmp_path / "new.yaml", made.new_weights),
                 "--out", tmp_path / "dst", "--json")
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    reasons = {row["id"]: row["reason"] for row in report["capsules"] if row["status"] == "skipped"}
    assert reasons == {V1_FIXTURE.stem: "no recipe (format version 1 files have none)",
                       off.id: "no recipe (it was saved with capsules.recipe off)"}, reasons
    assert report["regenerated"] == 3 and len(list((tmp_path / "dst").iterdir())) == 3


def check_json(capsys, directory: Path, params: Path, *extra: str) -> Tuple[int, dict]:
    code = check_cmd.main([str(directory), "--params", str(params), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_check_names_the_cause_of_every_invalidation(made, tmp_path, capsys):
    cases = {
        "weights": ({}, ["weights"], 0),
        # the hybrid keeps its action scale in a buffer: the weights' digest changes with it
        "architecture": ({"policy": {"hybrid": {"action_scale": 3.0}}}, ["weights", "architecture"], 0),
        "port mapping": ({"ports": {"joints": {"fields": ["velocity", "position"]}}}, ["ports"], 2),
    }
    for name, (extra, causes, exit_code) in cases.items():
        weights = made.new_weights if name == "weights" else made.tmp / "old.safetensors"
        code, report = check_json(capsys, made.src, params_file(tmp_path / f"{name}.yaml", weights, extra),
                                  "--steps-per-second", "1000")
        assert code == report["exit"] == exit_code, (name, report)
        assert [row["causes"] for row in report["capsules"]] == [causes] * 3, (name, report["capsules"])
        assert report["by_cause"] == dict.fromkeys(causes, 3)
    lost = {row["reason"] for row in report["capsules"]}
    assert lost == {"ports no longer compatible: input 'joints' is filled differently (its port's message type, "
                    "fields or names changed)"}, lost
    code, report = check_json(capsys, made.src, params_file(tmp_path / "same.yaml", made.tmp / "old.safetensors"))
    assert code == 0 and report["valid"] == 3 and report["regeneration_steps"] == 0
    v1 = tmp_path / "v1"
    v1.mkdir()
    shutil.copy(V1_FIXTURE, v1)
    code, report = check_json(capsys, v1, params_file(tmp_path / "new.yaml", made.new_weights))
    row = report["capsules"][0]
    assert code == 2 and row["causes"] == ["unsplit"] and "cannot be told" in row["why"], row
    code, report = check_json(capsys, made.src, params_file(tmp_path / "new.yaml", made.new_weights))
    assert code == 0 and report["steps_per_second"] > 0 and report["expected_seconds"] > 0
    assert report["storage_bytes"] > 3 * 144384 and report["recipe_coverage"] == 1.0


@pytest.fixture(scope="module")
def long_src(made) -> Path:
    """Four capsules 250 steps apart: a regeneration of some seconds, to interrupt."""
    config = dataclasses.replace(made.config, capsules=dataclasses.replace(
        made.config.capsules, directory=str(made.tmp / "long")))
    session = build_session(config)
    rows = observations(1000, seed=5)
    for start in range(0, 1000, 250):
        feed(session, rows[start:start + 250])
        session.verbs.commit(f"at {start + 250}", persist=True)
    session.release()
    return made.tmp / "long"


def test_kill_9_during_regenerate_leaves_no_dst_and_the_next_run_completes_it(made, long_src, tmp_path):
    new = params_file(tmp_path / "new.yaml", made.new_weights)
    dst = tmp_path / "dst"
    proc = subprocess.Popen(["capsule-ros", "regenerate", str(long_src), "--params", str(new), "--out", str(dst),
                             "--progress"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stderr:                           # wait for a capsule to be written, not for time
            lines.append(line)
            if ": regenerated" in line:
                break
        assert any(": regenerated" in line for line in lines), lines
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    staging = list(tmp_path.glob(".dst.regenerating-*"))
    assert not dst.exists() and len(staging) == 1 and any(staging[0].iterdir()), "a partial DST was published"
    result = cli("regenerate", long_src, "--params", new, "--out", dst, "--json")
    assert result.returncode == 0, result.stderr
    assert len(list(dst.iterdir())) == 4 and not list(tmp_path.glob(".dst.regenerating-*"))


def test_bad_destinations_are_refused_with_exit_3_and_nothing_written(made, tmp_path, capsys):
    new = params_file(tmp_path / "new.yaml", made.new_weights)
    before = files(made.src)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    for dst in (full, made.src / "inside", made.src):
        code = regenerate_cmd.main([str(made.src), "--params", str(new), "--out", str(dst)])
        assert code == 3, dst
        assert "DST" in capsys.readouterr().err
    assert files(made.src) == before and [p.name for p in full.iterdir()] == ["keep.txt"]
    assert regenerate_cmd.main([str(made.src), "--params", str(tmp_path / "nope.yaml"), "--out",
                                str(tmp_path / "d")]) == 3
    assert not (tmp_path / "d").exists()
