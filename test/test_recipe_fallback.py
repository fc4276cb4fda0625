"""The recompute fallback across processes: a capsule saved with its recipe is rebuilt
from it when its bytes are lost, by any later run of the node, byte-exact.

- In-process sessions over one capsule directory (the default policy's shape, random
  weights): capsules of an earlier session, one rooted at another capsule whose own file
  is damaged too (its recipe is followed), are rebuilt byte-exact; saving the rebuilt
  capsule keeps its file's recipe; a capsule of another fingerprint is never rebuilt
  silently.
- A camera policy (the LeRobot ACT fixture: a 48 x 64 rgb8 image and a chunk of actions):
  its recipe holds one input row per chunk, its size is what the format says, a recipe
  over ``capsules.recipe_max_mb`` is cut with the reason, and a rebuild from its recipe in
  another session is byte-exact.
- A fresh ``policy_node`` process rebuilds a capsule its predecessor saved, byte-exact
  (compared with the original file's bytes), and acts as the original did afterwards.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import (
    ClientNode,
    Driver,
    action_bytes,
    damage_state,
    observations as joint_rows,
    start_policy_node,
    state_bytes,
)
from lerobot_fixtures import PORTS, Fixture
from runtime_fixtures import default_config, feed, observations

from capsule_ros.capsules.recipe import CAPSULE, INITIAL
from capsule_ros.errors import ErrorCode, FingerprintMismatch
from capsule_ros.serving.config import ServingConfig
from capsule_ros.serving.factory import build_session


def arena(session) -> bytes:
    return bytes(session.parts.runtime.arena.storage.numpy())


def test_capsules_of_an_earlier_session_are_rebuilt_from_their_recipes(tmp_path):
    config = default_config(tmp_path)
    first = build_session(config)
    obs = observations(40, seed=21)
    feed(first, obs[:12])
    c1 = first.verbs.commit("c1", persist=True)
    feed(first, obs[12:20])
    c2 = first.verbs.commit("c2", persist=True)
    first.verbs.reset(c1.id)                                     # episode 2 starts from c1's state
    feed(first, obs[20:30])
    c3 = first.verbs.commit("c3", persist=True)
    first.release()                                        # the process ends; its files stay
    directory = first.parts.directory
    root_of = {c.id: directory.header(c.id).recipe.root for c in (c1, c2, c3)}
    assert root_of[c1.id].kind == INITIAL and root_of[c1.id].episode == 1
    assert (root_of[c3.id].kind, root_of[c3.id].capsule_id, root_of[c3.id].episode) == (CAPSULE, c1.id, 2)
    originals = {c.id: damage_state(directory.path_of(c.id)) for c in (c1, c3)}   # both lost: c3's root too

    second = build_session(config)
    feed(second, obs[30:35])
    result = second.verbs.reenter(c3.id)
    assert result.fallback and "checksum mismatch" in result.fallback_reason, result.fallback_reason
    assert (second.episode.episode_id, second.episode.step, second.episode.lineage) == (2, c3.step, c3.id)
    path = directory.path_of(c3.id)
    path.write_bytes(originals[c3.id])
    assert arena(second) == state_bytes(path), "the rebuild is not byte-exact"
    damage_state(path)
    rebuilt = second.parts.store.get(c3.id)
    assert (rebuilt.label, rebuilt.parent_id) == ("c3", c3.parent_id)       # as its file says
    second.verbs.save(c3.id)                                     # the rebuilt bytes replace the damaged file ...
    saved = directory.header(c3.id)
    assert saved.recipe.regenerable and saved.recipe.root == root_of[c3.id]   # ... with its recipe kept
    assert state_bytes(path) == arena(second)
    assert not second.verbs.reenter(c2.id).fallback              # an intact file restores as ever
    assert second.parts.loop.counters.fallback_recomputes == 1


def test_a_capsule_of_another_fingerprint_is_never_rebuilt_silently(tmp_path):
    config = default_config(tmp_path)
    first = build_session(config)
    feed(first, observations(6, seed=5))
    capsule = first.verbs.commit("old model", persist=True)
    first.release()
    changed = dataclasses.replace(config, policy=dataclasses.replace(config.policy, init_seed=1))   # other weights
    second = build_session(changed)
    before = arena(second), second.episode.step, second.episode.lineage
    with pytest.raises(FingerprintMismatch) as info:
        second.verbs.reenter(capsule.id)
    assert "capsule-ros regenerate" in str(info.value) and info.value.code == ErrorCode.FINGERPRINT_MISMATCH
    assert (arena(second), second.episode.step, second.episode.lineage) == before


# -- a camera policy ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def act(tmp_path_factory):
    return Fixture.load("act_queue", tmp_path_factory.mktemp("act"))


def act_config(fixture: Fixture, tmp_path, **capsules) -> ServingConfig:
    params = fixture.serving_params()
    params["capsules"].update(directory=str(tmp_path / "capsules"), **capsules)
    params["control"]["input_log_steps"] = 200
    return ServingConfig.from_params(params)


def feed_act(session, fixture: Fixture, start: int, stop: int) -> None:
    for t in range(start, stop):
        for key, values in fixture.features.items():
            session.loop.write_input(PORTS[key], values[0, t])
        assert session.loop.tick() is not None


def test_a_camera_policys_recipe_holds_a_row_per_chunk_and_honours_its_bound(act, tmp_path):
    config = act_config(act, tmp_path)
    session = build_session(config)
    feed_act(session, act, 0, 45)
    capsule = session.verbs.commit("camera", persist=True)
    info = session.parts.directory.header(capsule.id).recipe
    horizon = session.parts.runtime.mode.schedule.execution_horizon
    assert info.regenerable and info.steps == 45 and info.rows == -(-45 // horizon) < 45, info
    assert info.row_bytes >= 48 * 64 * 3 and info.nbytes == -(-45 // 8) + 45 * info.action_dim * 4 + info.rows * \
        info.row_bytes
    assert {i.name for i in info.inputs} == {"joints", "front_camera"}
    bound_mb = (info.nbytes - 1) / 2**20                    # one byte short of what it needs
    session.release()

    tight = build_session(act_config(act, tmp_path / "tight", recipe_max_mb=bound_mb))
    feed_act(tight, act, 0, 45)
    cut = tight.parts.directory.header(tight.verbs.commit("camera", persist=True).id).recipe
    assert not cut.regenerable and cut.nbytes == 0
    assert f"its recipe would take {info.nbytes:,} bytes" in cut.reason and "capsules.recipe_max_mb" in cut.reason
    tight.release()

    path = session.parts.directory.path_of(capsule.id)
    original = damage_state(path)
    again = build_session(config)                          # another session rebuilds it from its recipe
    result = again.verbs.reenter(capsule.id)
    path.write_bytes(original)
    assert result.fallback and arena(again) == state_bytes(path)


# -- a fresh policy_node process ----------------------------------------------------------------------------
@pytest.mark.ros
def test_a_fresh_node_rebuilds_a_capsule_of_its_predecessor_byte_exact(tmp_path, rclpy_context):
    params = {"policy": {"weights": ""}, "control": {"deadline_ms": 5000.0}}
    obs = joint_rows(30, seed=8)
    node = start_policy_node(tmp_path, params, namespace="/rf")
    client = ClientNode(rclpy_context, "recipe_fallback_client", node_path="/rf/capsule_policy")
    try:
        driver = Driver(client, "/rf")
        driver.send_goal()
        driver.run(obs[:12])
        capsule = client.capsules.commit(label="k", persist=True).capsule
        after = action_bytes(driver.run(obs[12:20]))
        assert node.stop() == 0, node.log()
        path = tmp_path / "policy-capsules" / f"{capsule.id}.capsule"
        original = state_bytes(path)
        damage_state(path)

        fresh = start_policy_node(tmp_path, params, namespace="/rf")
        try:
            driver = Driver(client, "/rf")
            driver.send_goal()
            response = client.capsules.reenter(capsule.id)
            assert response.success and response.fallback, response.message
            assert action_bytes(driver.run(obs[12:20])) == after, "the rebuilt state acts otherwise"
            client.capsules.reenter(capsule.id)            # back to it (in memory now) and save it
            assert client.capsules.save(capsule.id).success
            assert state_bytes(path) == original, "the rebuilt bytes differ from the original file's"
        finally:
            assert fresh.stop() == 0, fresh.log()
    finally:
        client.close()
        node.stop()
    assert np.frombuffer(original, np.uint8).size == capsule.bytes
