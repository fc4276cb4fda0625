"""A capsule's recipe is bound to the capsule, and the recompute fallback says which way
it rebuilt a capsule and why the other way could not (issue 30, items 1 and 2).

- A plain capsule file re-tagged (as anyone can: docs/capsule-format.md §5) so that its
  recipe's root names another episode than its header, or carrying another capsule's
  recipe of the same step, is refused as CORRUPT with the reason, with the live state
  untouched: the header's episode and step must agree with the recipe, and the bytes a
  recipe rebuilds must have the header's state digest.
- A capsule whose log root left memory is rebuilt from its file's recipe (the root's file
  is intact), and the answer says so and why the log could not.
- After ``drop(from_disk=True)`` in the process that made a capsule, a re-enter's
  NOT_FOUND says it was dropped.

In-process sessions over one capsule directory (the default policy's shape, random
weights); a second session is a later run of the node.
"""
from __future__ import annotations

import copy

import pytest
from harness import damage_state, recipe_section, retag, state_bytes
from runtime_fixtures import default_config, feed, observations

from capsule_ros.errors import CorruptCapsule, ErrorCode, NotFound
from capsule_ros.serving.factory import build_session


def live(session) -> tuple:
    """What a refused re-enter must leave as it was: the arena's bytes and the episode."""
    episode = session.episode
    return bytes(session.parts.runtime.arena.storage.numpy()), episode.episode_id, episode.step, episode.lineage


def test_a_recipe_whose_root_names_another_episode_is_refused(tmp_path):
    config = default_config(tmp_path)
    first = build_session(config)
    feed(first, observations(12, seed=3))
    capsule = first.verbs.commit("c", persist=True)
    first.release()
    path = first.parts.directory.path_of(capsule.id)
    assert first.parts.directory.header(capsule.id).recipe.root.episode == capsule.episode_id

    def other_episode(header: dict) -> None:
        header["recipe"]["root"]["episode"] = capsule.episode_id + 4
    retag(path, other_episode)
    damage_state(path)

    second = build_session(config)
    feed(second, observations(5, seed=4))
    before = live(second)
    with pytest.raises(CorruptCapsule) as info:
        second.verbs.reenter(capsule.id)
    assert info.value.code == ErrorCode.CORRUPT
    assert f"episode {capsule.episode_id + 4}" in str(info.value) and "no recompute fallback" in str(info.value), \
        str(info.value)
    assert live(second) == before, "a refused re-enter changed the live state"
    assert second.parts.loop.counters.fallback_recomputes == 0


def test_another_capsules_recipe_of_the_same_step_is_refused(tmp_path):
    config = default_config(tmp_path)
    first = build_session(config)
    obs = observations(30, seed=6)
    feed(first, obs[:5])
    fork_point = first.verbs.commit("fork point")
    feed(first, obs[5:12])
    mine = first.verbs.commit("mine", persist=True)
    first.verbs.reenter(fork_point.id)                        # a rollback: another timeline of the episode
    feed(first, obs[12:19])
    other = first.verbs.commit("other", persist=True)
    assert (other.episode_id, other.step) == (mine.episode_id, mine.step)
    first.release()
    directory = first.parts.directory
    mine_path, other_path = directory.path_of(mine.id), directory.path_of(other.id)
    original = state_bytes(mine_path)
    other_recipe = copy.deepcopy(directory.header(other.id).recipe.to_json())

    def swap(header: dict) -> None:
        header["recipe"] = other_recipe
    retag(mine_path, swap, recipe=recipe_section(other_path))
    assert state_bytes(mine_path) == original          # the state is untouched and the file verifies ...
    damage_state(mine_path)                            # ... until its state is lost: the fallback's turn

    second = build_session(config)
    feed(second, obs[19:24])
    before = live(second)
    with pytest.raises(CorruptCapsule) as info:
        second.verbs.reenter(mine.id)
    assert info.value.code == ErrorCode.CORRUPT
    assert "not the capsule's" in str(info.value) and "state digest" in str(info.value), str(info.value)
    assert live(second) == before, "a refused re-enter changed the live state"
    assert mine.id not in second.parts.store, "the mismatching rebuild was kept"
    assert not second.verbs.reenter(other.id).fallback       # the other capsule's own file is fine


def test_a_capsule_whose_log_root_left_memory_is_rebuilt_from_its_files_recipe(tmp_path):
    config = default_config(tmp_path)
    first = build_session(config)
    obs = observations(30, seed=9)
    feed(first, obs[:6])
    root = first.verbs.commit("P", persist=True)
    first.release()

    second = build_session(config)                            # a later run re-enters P ...
    assert not second.verbs.reenter(root.id).fallback
    feed(second, obs[6:14])
    capsule = second.verbs.commit("C", persist=True)          # ... and makes C on top of it
    assert second.parts.recompute.root_id == root.id
    path = second.parts.directory.path_of(capsule.id)
    original = state_bytes(path)
    feed(second, obs[14:18])
    second.verbs.drop(capsule.id)
    second.verbs.drop(root.id)                                # the log root leaves memory; its file stays
    damage_state(path)

    result = second.verbs.reenter(capsule.id)
    assert result.fallback and "checksum mismatch" in result.fallback_reason, result.fallback_reason
    assert "recipe" in result.fallback_source and f"the log root {root.id!r} is no longer in memory" in \
        result.fallback_source, result.fallback_source
    assert bytes(second.parts.runtime.arena.storage.numpy()) == original, "the rebuild is not the capsule's state"
    assert (second.episode.step, second.episode.lineage) == (capsule.step, capsule.id)


def test_a_capsule_rebuilt_from_the_input_log_says_so(tmp_path):
    session = build_session(default_config(tmp_path))
    feed(session, observations(10, seed=2))
    capsule = session.verbs.commit("c", persist=True)
    feed(session, observations(4, seed=3))
    session.verbs.drop(capsule.id)
    damage_state(session.parts.directory.path_of(capsule.id))
    result = session.verbs.reenter(capsule.id)
    assert result.fallback and result.fallback_source == "the input log", result.fallback_source


def test_a_capsule_dropped_from_memory_and_disk_is_not_found_as_dropped(tmp_path):
    session = build_session(default_config(tmp_path))
    feed(session, observations(8, seed=1))
    capsule = session.verbs.commit("c", persist=True)
    feed(session, observations(3, seed=2))
    session.verbs.drop(capsule.id, from_disk=True)
    with pytest.raises(NotFound) as info:
        session.verbs.reenter(capsule.id)
    message = str(info.value)
    assert "dropped" in message and "did not make" not in message, message


def test_a_file_from_before_state_digests_is_rebuilt_and_says_its_state_was_not_compared(tmp_path):
    """A version 2 file written before headers carried ``state_digest`` (the key removed
    here) still has its recipe rebuilt, with the header's episode and step and every
    recorded action checked; the answer says the bytes could not be compared."""
    config = default_config(tmp_path)
    first = build_session(config)
    feed(first, observations(9, seed=12))
    capsule = first.verbs.commit("old", persist=True)
    first.release()
    path = first.parts.directory.path_of(capsule.id)
    original = state_bytes(path)
    assert first.parts.directory.header(capsule.id).state_digest
    retag(path, lambda header: header.pop("state_digest"))
    assert not first.parts.directory.header(capsule.id).state_digest
    damage_state(path)

    second = build_session(config)
    result = second.verbs.reenter(capsule.id)
    assert result.fallback and "no state digest" in result.fallback_source, result.fallback_source
    assert bytes(second.parts.runtime.arena.storage.numpy()) == original
