"""Rosbag record and replay: a rollback recorded through the real node replays bit for bit.

The bags that must be bit-identical are recorded here, through an installed
``policy_node`` and its ``~/record`` service (module fixture ``live``), because
bit-identity holds for one machine, build and config; the committed fixture bags
(test/fixtures/, made by make_bags.py with the same scenarios) serve the checks that do
not depend on the build: damaged bags, the independent MCAP reader, metadata fields.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cpu_references import bag_fixtures
from fixtures.make_bags import NODE_PARAMS, K, N, observations, record_events, record_rollback
from harness import REPO, ClientNode, Driver, restore_node, set_params_ok, start_policy_node, wait_for

from capsule_ros.bag.edit import rewrite_bag
from capsule_ros.bag.reader import ACTION, BAG_INFO_FIELDS, ActionInfo, BagScan, RecordedEvent, Recording
from capsule_ros.bag.replay import ReplayOptions, replay_bag
from capsule_ros.bag.schedule import AT, BEFORE, Scheduler
from capsule_ros.cli.replay_cmd import main as replay_main, replay
from capsule_ros.serving.records import EventKind

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NS = "/tbag"
CLI = [sys.executable, "-m", "capsule_ros.cli.main"]


@pytest.fixture(scope="module")
def live(tmp_path_factory, rclpy_context):
    """One policy_node; the rollback (MCAP) and events (sqlite3) scenarios recorded through ~/record."""
    tmp = tmp_path_factory.mktemp("bag")
    proc = start_policy_node(tmp, NODE_PARAMS, namespace=NS, tag="bagnode")
    client = ClientNode(rclpy_context, "bag_test_client", node_path=f"{NS}/capsule_policy")
    try:
        driver = Driver(client, NS)
        rollback = record_rollback(driver, tmp / "rollback", "mcap")
        events = record_events(driver, tmp / "events", "sqlite3")
        yield SimpleNamespace(tmp=tmp, proc=proc, client=client, driver=driver, rollback=rollback, events=events)
    finally:
        client.close()
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def node(live):
    """The module's node for a test that drives it: restored to a fresh node's state first
    (``restore_node``), so each such test stands alone."""
    restore_node(live.client, {"control__mode": "trigger", "control__rate_hz": 20.0, "control__deadline_ms": 5000.0,
                               "ports__goal__staleness_ms": 0.0})
    ClientNode.drain(live.driver.actions)
    return live


def run_cli(*args, timeout=180):
    """``capsule-ros replay`` / ``record`` in a fresh process."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def changed_copy(src: Path, dst: Path, step: int, delta: float = 0.25) -> int:
    """A consistent copy of a bag in which the joint state that triggered recorded step
    ``step`` (its first occurrence) has position[0] changed; returns that message's index."""
    with Recording(src) as recording:
        scan = recording.scan()
    action = next(a for a in scan.actions if a.step == step)
    trigger = max(t for t in scan.trigger_times if t < action.time)
    changed = []

    def change(entry, recording):
        if entry.time != trigger:
            return entry.data
        msg = recording.decode(entry)
        position = msg.position.copy()
        position[0] += delta
        changed.append(entry.index)
        return recording.typestore.serialize_cdr(dataclasses.replace(msg, position=position), entry.msgtype)

    rewrite_bag(src, dst, change)
    return changed[0]


# -- the contract: record a rollback through the node, replay it bit for bit ------------------------

@pytest.mark.ros
def test_rollback_recorded_through_the_node_replays_bit_identically(live):
    info = live.rollback
    assert info["identical_live"], "the node itself did not repeat the actions after the rollback"
    verdict = replay_bag(info["bag"])
    assert verdict.first_divergence is None, verdict.first_divergence
    assert verdict.identical and verdict.exit_code() == 0
    assert verdict.steps_compared == verdict.steps_matched == N + (N - K)
    assert verdict.steps_skipped == verdict.steps_before_anchor == 0 and verdict.start == "the initial state"
    assert verdict.events_replayed == {"COMMIT": 1, "REENTER": 1}
    assert verdict.fingerprint_recorded and verdict.fingerprint_replay == verdict.fingerprint_recorded


@pytest.mark.ros
def test_every_capsule_event_kind_replays(live):
    verdict = replay_bag(live.events["bag"])
    assert verdict.identical, (verdict.first_divergence, verdict.notes)
    assert set(verdict.events_replayed) == {"COMMIT", "INTERRUPT", "REENTER", "RESET", "FORK", "DROP", "LOAD"}
    assert verdict.events_skipped == {"SAVE": 1}
    assert verdict.steps_skipped == verdict.steps_before_anchor == 0 and verdict.steps_compared >= 30


@pytest.mark.ros
def test_changed_sensor_value_diverges_exactly_at_its_step(live, tmp_path, capsys):
    j = K + 7
    changed = changed_copy(Path(live.rollback["bag"]), tmp_path / "changed", j)
    assert replay_main([str(tmp_path / "changed"), "--verify", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    first = report["first_divergence"]
    assert first["step"] == j and first["port"] == "joints" and "values" in first["what"]
    assert first["max_abs_diff"] > 0 and first["bag_index"] > changed
    # the rollback re-enters step K and replays unchanged messages: identical again
    assert report["steps_diverged"] == N - j + 1
    assert report["steps_matched"] == report["steps_compared"] - report["steps_diverged"]


@pytest.mark.ros
def test_kv_only_reentry_diverges(live, capsys):
    bag = live.rollback["bag"]
    assert replay_main([bag, "--verify", "--json", "--ablation", "kv-only"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_divergence"]["step"] == K + 1       # the first step after the re-entry
    # KV and metadata restored, recurrent / conv / chunk state not: still diverges
    verdict = replay_bag(bag, ReplayOptions(ablation="kv-meta"))
    assert not verdict.identical and verdict.first_divergence.step == K + 1
    assert "values" in verdict.first_divergence.what and "step" not in verdict.first_divergence.what


@pytest.mark.ros
def test_cross_process_replay_from_the_saved_capsule(live):
    """Recorded by the node process (capsule saved with persist=true), replayed in a fresh
    process that loads the capsule from the directory the bag's config names."""
    info = live.rollback
    result = run_cli("replay", info["bag"], "--verify", "--json", "--from-capsule", info["capsule_id"])
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] and info["capsule_id"] in report["start"]
    assert report["steps_compared"] == 2 * (N - K) and report["steps_before_anchor"] == K


@pytest.mark.ros
def test_node_mode_verifies_a_bag(live):
    verdict = replay(live.rollback["bag"], ReplayOptions(node=True, timeout_s=90))
    assert verdict.target == "policy_node"
    assert verdict.identical, (verdict.first_divergence, verdict.notes)
    assert verdict.steps_compared == N + (N - K)


@pytest.mark.ros
def test_record_cli_asks_the_node_to_record(node, tmp_path):
    """`capsule-ros record` until Ctrl-C, while a reset episode runs: a verifiable sqlite3 bag."""
    out = tmp_path / "cli_bag"
    proc = subprocess.Popen([*CLI, "record", "--node", f"{NS}/capsule_policy", "--out", str(out),
                             "--storage", "sqlite3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        started = proc.stderr.readline()
        assert started.startswith("recording"), started + proc.stderr.read()
        node.driver.capsules.reset()
        node.driver.send_goal(0.1, 0.2)
        node.driver.run(observations(5, 40))
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert stdout.strip() == str(out)
    verdict = replay_bag(out)
    assert verdict.identical and verdict.steps_compared == 5 and verdict.storage == "sqlite3"


@pytest.mark.ros
def test_bag_started_mid_run_is_verified_from_a_reentered_capsule_file(live, tmp_path, capsys):
    """Without the bag's start, the replay anchors where it re-enters a capsule whose file
    the node saved; without that file nothing can be verified (exit 2)."""
    bag = Path(live.rollback["bag"])
    with Recording(bag) as recording:
        commit = next(e for e in recording.scan().events if e.kind == EventKind.COMMIT)
    late = tmp_path / "late"
    rewrite_bag(bag, late, lambda e, r: e.data if e.index >= commit.index or e.port == "goal" else None)
    verdict = replay_bag(late)
    assert verdict.identical and verdict.start == f"capsule {commit.capsule_id} (REENTER)"
    assert verdict.steps_compared == N - K and verdict.steps_before_anchor == N - K
    assert replay_main([str(late), "--verify", "--capsule-dir", str(tmp_path)]) == 2
    assert "nothing verified" in capsys.readouterr().err
    no_goal = tmp_path / "no_goal"                   # the goal was sent before the recording began
    rewrite_bag(late, no_goal, lambda e, r: None if e.port == "goal" else e.data)
    verdict = replay_bag(no_goal)
    assert verdict.first_divergence.what == "missing" and "['goal']" in verdict.first_divergence.detail


@pytest.mark.ros
def test_timer_mode_bag_steps_where_the_node_acted(node, tmp_path):
    """In timer mode steps follow the wall clock; in process, the replay steps at each
    recorded action with the inputs the bag delivered before it."""
    import time
    driver = node.driver
    set_params_ok(node.client, None, control__mode="timer", control__rate_hz=50.0)
    try:
        wait_for(lambda: driver.actions.qsize() >= 2, timeout=10, what="the timer's first steps")
        driver.capsules.record(True, str(tmp_path / "timer"), "mcap")   # of a node that was running already
        driver.send_goal(0.2, -0.3)                       # inputs first: the replay only has the bag's
        received = driver.port("joints").received
        driver.joints_pub.publish(driver.joint_msg(observations(1, 50)[0]))
        wait_for(lambda: driver.port("joints").received > received, timeout=10, what="the joint state")
        driver.capsules.reset()
        for values in observations(8, 51):                # a sensor at 25 Hz, the policy at 50 Hz
            driver.joints_pub.publish(driver.joint_msg(values))
            time.sleep(0.04)
        ClientNode.drain(driver.actions)
        wait_for(lambda: driver.actions.qsize() >= 3, timeout=10, what="steps after the last joint state")
        driver.capsules.record(False)
    finally:
        set_params_ok(node.client, None, control__mode="trigger")
    verdict = replay_bag(tmp_path / "timer")
    assert verdict.mode == "timer" and verdict.start == "a reset to the initial state"
    assert verdict.identical, (verdict.first_divergence, verdict.notes)
    assert verdict.steps_compared >= 10
    with pytest.raises(Exception, match="timer mode"):
        replay(tmp_path / "timer", ReplayOptions(node=True))


@pytest.mark.ros
def test_params_file_overrides_or_supplies_the_config(live, tmp_path):
    from capsule_ros.bag.metadata import params_yaml
    bag = Path(live.rollback["bag"])
    with Recording(bag) as recording:
        params = recording.meta.params
    same = tmp_path / "same.yaml"
    same.write_text(params_yaml(params))
    other = tmp_path / "other.yaml"
    other.write_text(params_yaml({**params, "policy": {**params["policy"], "init_seed": 1}}))
    verdict = replay_bag(bag, ReplayOptions(params_file=other))     # other random weights
    assert verdict.first_divergence.step == 1 and any("fingerprint" in note for note in verdict.notes)
    # a bag without capsule_ros metadata (as `ros2 bag record` writes it) replays with --params-file
    foreign = tmp_path / "foreign"
    shutil.copytree(bag, foreign)
    meta = yaml.safe_load((foreign / "metadata.yaml").read_text())
    meta["rosbag2_bagfile_information"]["custom_data"] = None
    (foreign / "metadata.yaml").write_text(yaml.safe_dump(meta))
    assert replay_main([str(foreign), "--verify"]) == 2
    verdict = replay_bag(foreign, ReplayOptions(params_file=same))
    assert verdict.identical and verdict.steps_compared == N + (N - K)


@pytest.mark.ros
def test_recordings_with_persisting_commits_at_random_moments_all_verify(node, tmp_path):
    """20 recordings of a robot stepping at 100 Hz while a behaviour tree commits with
    persist at random moments (the steps during each save carry the new lineage, as the
    events say): every one verifies."""
    import random
    import time
    driver, rng = node.driver, random.Random(20261130)
    verdicts = []
    for i in range(20):
        driver.capsules.reset()
        bag = driver.capsules.record(True, str(tmp_path / f"commits{i}"), "mcap").bag_path
        stop, rows = threading.Event(), iter(observations(200, 300 + i))

        def stream():
            while not stop.is_set():
                driver.joints_pub.publish(driver.joint_msg(next(rows)))
                time.sleep(0.01)
        streamer = threading.Thread(target=stream)
        streamer.start()
        for _ in range(rng.randint(1, 3)):
            time.sleep(rng.uniform(0.0, 0.3))
            driver.capsules.commit(label=f"bag {i}", persist=True)
        time.sleep(rng.uniform(0.05, 0.2))
        stop.set()
        streamer.join()
        driver.capsules.record(False)                 # maybe mid-step: the replay reports it as the end
        verdicts.append(replay_bag(bag))
    bad = [(i, v.first_divergence, v.notes) for i, v in enumerate(verdicts) if v.exit_code() != 0]
    assert bad == [], f"{len(bad)} of 20 honest recordings did not verify: {bad[:2]}"
    assert all(v.steps_compared >= 10 and v.events_replayed.get("COMMIT") for v in verdicts)


@pytest.mark.ros
def test_the_in_process_replay_counts_the_stale_steps_the_node_counted(node, tmp_path):
    """Staleness is judged on the receiver's clock: the node's, and in a replay the log
    time (when the node received each message). A goal that goes stale during a recording
    makes the replay's session count the stale steps the node counted."""
    import time

    from capsule_ros.bag.replay import Replayer
    from capsule_ros.bag.targets import InProcessTarget
    driver = node.driver
    set_params_ok(node.client, None, ports__goal__staleness_ms=1000.0)
    before = driver.port("goal").stale_steps
    bag = driver.capsules.record(True, str(tmp_path / "stale"), "mcap").bag_path
    driver.send_goal(0.1, 0.2)                         # after the start: the bag has when the node took it
    driver.run(observations(2, 70))                    # fresh
    time.sleep(1.6)                                    # the scenario: the goal ages past its 1000 ms
    driver.run(observations(2, 71))                    # stale
    driver.capsules.record(False)
    counted = driver.port("goal").stale_steps - before
    assert counted >= 2
    with Recording(Path(bag)) as recording:
        target = InProcessTarget(recording.config, None)
        verdict = Replayer(recording, target, ReplayOptions()).run()
    assert verdict.identical, (verdict.first_divergence, verdict.notes)
    assert target.session.parts.loop.ports["goal"].counters.stale_steps == counted
    assert target.session.parts.loop.ports["joints"].counters.stale_steps == 0


@pytest.mark.ros
def test_a_recording_stopped_mid_step_ends_at_its_last_action(live, tmp_path, capsys):
    """The bag's last message is a trigger whose action was never recorded."""
    bag = Path(live.rollback["bag"])
    with Recording(bag) as recording:
        scan = recording.scan()
    last_action = scan.actions[-1].time
    cut = tmp_path / "cut"
    rewrite_bag(bag, cut, lambda e, r: None if e.kind == ACTION and e.time == last_action else e.data)
    with Recording(cut) as recording:
        assert len(recording.scan().actions) == len(scan.actions) - 1
    assert replay_main([str(cut), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps_unrecorded"] == 1 and report["first_divergence"] is None
    assert report["steps_compared"] == N + (N - K) - 1 and report["complete"]


@pytest.mark.ros
def test_a_recording_that_ends_trigger_trigger_action_leaves_the_last_step_unrecorded(live, tmp_path, capsys):
    """A fleet steps a robot's waiting request when its next message comes, so its bag can end
    with two triggers and then the first one's action (the recording stopped before the
    second's): the replay compares the first and counts the second as not recorded, not as
    a step the replay took where the recording did not."""
    from capsule_ros.bag.reader import SENSOR
    from capsule_ros.bag.recorder import write_bag
    bag = Path(live.rollback["bag"])
    with Recording(bag) as recording:
        entries = list(recording.entries())
        trigger = recording.config.control.trigger_port
        last_action = max(i for i, e in enumerate(entries) if e.kind == ACTION)
        last_trigger = max(i for i, e in enumerate(entries[:last_action]) if e.kind == SENSOR and e.port == trigger)
        answered = max(i for i, e in enumerate(entries[:last_trigger]) if e.kind == ACTION)
        assert entries[answered - 1].kind == SENSOR and entries[answered - 1].port == trigger
        moved = entries[last_trigger]          # the last trigger, now before the action of the one before it
        between = (entries[answered - 1].time + entries[answered].time) // 2
        order = [*entries[:answered], dataclasses.replace(moved, time=between),
                 *(e for i, e in enumerate(entries[answered:], answered) if i not in (last_trigger, last_action))]
        cut = tmp_path / "trigger-trigger-action"
        write_bag(cut, recording.storage, recording.meta, recording.typestore,
                  ((e.topic, e.msgtype, e.data, e.time) for e in order))
    assert replay_main([str(cut), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["first_divergence"] is None and report["identical"], report["first_divergence"]
    assert report["steps_unrecorded"] == 1 and report["complete"]


@pytest.mark.ros
def test_a_replay_that_skips_actions_is_not_called_verified(live, tmp_path, capsys):
    """Without the capsule file the rollback's re-entry cannot be reproduced: the actions
    after it are skipped, and --verify says so with its own exit code."""
    empty = tmp_path / "no_capsules"
    empty.mkdir()
    bag = live.rollback["bag"]
    with Recording(Path(bag)) as recording:
        commit = next(e for e in recording.scan().events if e.kind == EventKind.COMMIT)
    no_commit = tmp_path / "no_commit"               # the re-entered capsule's COMMIT is not in the bag
    rewrite_bag(Path(bag), no_commit, lambda e, r: None if e.index == commit.index else e.data)
    assert replay_main([str(no_commit), "--verify", "--json", "--capsule-dir", str(empty)]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["steps_compared"] == N and report["steps_skipped"] == N - K and not report["complete"]
    assert report["first_divergence"] is None
    assert replay_main([str(no_commit), "--verify", "--partial", "--capsule-dir", str(empty)]) == 0
    assert "PARTIALLY VERIFIED" in capsys.readouterr().out
    assert replay_main([str(no_commit), "--capsule-dir", str(empty)]) == 0      # no --verify: report only


@pytest.mark.ros
def test_recorded_deadline_misses_are_reenacted_and_compared(node, tmp_path):
    """Steps that missed their deadline published HOLD; in process the replay re-enacts the
    misses and compares the held values; through a node it cannot, and says so (partial)."""
    driver = node.driver
    driver.capsules.reset()
    bag = driver.capsules.record(True, str(tmp_path / "late"), "mcap").bag_path
    driver.run(observations(4, 60))
    set_params_ok(node.client, None, control__deadline_ms=0.001)
    try:
        held = driver.run(observations(4, 61))
    finally:
        set_params_ok(node.client, None, control__deadline_ms=5000.0)
    driver.run(observations(4, 62))
    driver.capsules.record(False)
    assert all(a.source == a.SOURCE_HOLD for a in held)
    verdict = replay_bag(bag)
    assert verdict.exit_code() == 0 and verdict.complete, (verdict.first_divergence, verdict.notes)
    assert verdict.deadline_misses == 4 and verdict.steps_compared == 12
    node = replay(bag, ReplayOptions(node=True, timeout_s=90))
    assert node.first_divergence is None and node.steps_skipped == 4 and node.exit_code() == 3
    assert node.exit_code(allow_partial=True) == 0


# -- bad bags --------------------------------------------------------------------------------------

def _damaged(tmp_path: Path):
    """name -> a damaged copy of the MCAP fixture bag (or of the sqlite3 one)."""
    def copy(name, source="rollback_mcap"):
        dst = tmp_path / name
        shutil.copytree(FIXTURES / source, dst)
        return dst

    out = {}
    bag = copy("truncated")
    data = (bag / "rollback_mcap.mcap").read_bytes()
    (bag / "rollback_mcap.mcap").write_bytes(data[:len(data) // 2])
    out["truncated"] = bag
    bag = copy("garbled")
    data = bytearray((bag / "rollback_mcap.mcap").read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0x5A
    (bag / "rollback_mcap.mcap").write_bytes(bytes(data))
    out["garbled"] = bag
    bag = copy("garbled_value")                       # one float's bytes, framing intact
    data = bytearray((bag / "rollback_mcap.mcap").read_bytes())
    at = data.find(b"shoulder") + 40
    data[at:at + 4] = b"\x12\x34\x56\x78"
    (bag / "rollback_mcap.mcap").write_bytes(bytes(data))
    out["garbled_value"] = bag
    bag = copy("no_metadata")
    (bag / "metadata.yaml").unlink()
    out["no_metadata"] = bag
    bag = copy("no_config")
    meta = yaml.safe_load((bag / "metadata.yaml").read_text())
    meta["rosbag2_bagfile_information"]["custom_data"] = None
    (bag / "metadata.yaml").write_text(yaml.safe_dump(meta))
    out["no_config"] = bag
    bag = copy("garbled_sqlite", "events_sqlite3")
    db = bag / "events_sqlite3.db3"
    data = bytearray(db.read_bytes())
    data[4096:8192] = os.urandom(4096)
    db.write_bytes(bytes(data))
    out["garbled_sqlite"] = bag
    out["not_a_bag"] = tmp_path
    return out


def test_bad_bags_exit_2_with_a_one_line_reason(tmp_path, capsys):
    for name, bag in _damaged(tmp_path).items():
        code = replay_main([str(bag), "--verify"])
        err = capsys.readouterr().err.strip()
        assert code == 2, (name, err)
        assert err.startswith("capsule-ros replay: ") and "\n" not in err and "Traceback" not in err, (name, err)
    moved = tmp_path / "port_topic_not_in_bag"       # the recorded config names a topic the bag lacks
    shutil.copytree(FIXTURES / "rollback_mcap", moved)
    text = (moved / "metadata.yaml").read_text()
    (moved / "metadata.yaml").write_text(text.replace('"/fixture/arm/joint_states"', '"/fixture/arm/elsewhere"'))
    assert replay_main([str(moved)]) == 2
    assert "lacks topic(s) ['/fixture/arm/elsewhere']" in capsys.readouterr().err


def test_truncated_bag_in_a_fresh_process_has_no_traceback(tmp_path):
    bag = _damaged(tmp_path)["truncated"]
    result = run_cli("replay", bag, "--verify")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


# -- the bag format ------------------------------------------------------------------------------------

def _rihs01(msgtype: str) -> str:
    """The type hash rosidl generated for one of our messages (install/.../msg/<Name>.json)."""
    name = msgtype.rsplit("/", 1)[-1]
    path = REPO / "install" / "capsule_ros" / "share" / "capsule_ros" / "msg" / f"{name}.json"
    hashes = json.loads(path.read_text())["type_hashes"]
    return next(h["hash_string"] for h in hashes if h["type_name"] == msgtype)


@pytest.mark.parametrize("bag", ["rollback_mcap", "events_sqlite3"])
def test_metadata_has_what_ros2_bag_info_reads(bag):
    info = yaml.safe_load((FIXTURES / bag / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    assert set(BAG_INFO_FIELDS) <= set(info)
    assert info["version"] == 9 and info["storage_identifier"] == bag.split("_")[-1]
    assert info["message_count"] == sum(t["message_count"] for t in info["topics_with_message_count"])
    assert [f["path"] for f in info["files"]] == info["relative_file_paths"]
    topics = {t["topic_metadata"]["name"]: t["topic_metadata"] for t in info["topics_with_message_count"]}
    for meta in topics.values():
        assert {"name", "type", "serialization_format", "offered_qos_profiles", "type_description_hash"} <= set(meta)
        assert meta["serialization_format"] == "cdr" and meta["type_description_hash"].startswith("RIHS01_")
    for msgtype in ("capsule_ros/msg/Action", "capsule_ros/msg/CapsuleEvent"):
        assert [m["type_description_hash"] for m in topics.values() if m["type"] == msgtype] == [_rihs01(msgtype)]
    custom = info["custom_data"]
    assert custom["capsule_ros.trigger_port"] == "joints" and len(custom["capsule_ros.fingerprint"]) == 64
    assert "ros__parameters" in custom["capsule_ros.params"]


def test_independent_mcap_reader_decodes_every_message():
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory
    info = yaml.safe_load((FIXTURES / "rollback_mcap" / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    expected = {t["topic_metadata"]["name"]: t["message_count"] for t in info["topics_with_message_count"]}
    counts, steps, kinds = {}, [], []
    with open(FIXTURES / "rollback_mcap" / "rollback_mcap.mcap", "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        for schema, channel, _, msg in reader.iter_decoded_messages():
            counts[channel.topic] = counts.get(channel.topic, 0) + 1
            if schema.name == "capsule_ros/msg/Action":
                assert len(msg.values) == msg.action_dim == 2
                steps.append(msg.step)
            elif schema.name == "capsule_ros/msg/CapsuleEvent":
                kinds.append(msg.kind)
    assert counts == expected
    assert steps == list(range(1, N + 1)) + list(range(K + 1, N + 1))
    assert kinds == [EventKind.COMMIT, EventKind.SAVE, EventKind.REENTER]          # the commit persisted: SAVE


def test_fixture_bags_replay_bit_identically_on_a_machine_of_their_cpu_class():
    """The committed bags were recorded at the pinned CPU numerics level avx2 (make_bags.py):
    they verify here whatever this machine's own vector ISA, where its CPU computes the
    level's kernels as the recording one did (``cpu_references``: a class of its own has its
    own recordings), with the torch build of requirements/ (a new torch needs new fixtures:
    make_bags.py)."""
    from capsule_ros.bag.metadata import runtime_versions
    bags = bag_fixtures()
    manifest = json.loads((bags / "manifest.json").read_text())
    for name in ("rollback_mcap", "events_sqlite3"):
        with Recording(bags / name) as recording:
            assert recording.meta.numerics == "avx2" and recording.config.runtime.numerics == "avx2"
            assert recording.meta.versions["torch"] == runtime_versions()["torch"], \
                "the fixture bags were recorded with another torch build: regenerate them (test/fixtures/make_bags.py)"
    verdict = replay_bag(bags / "rollback_mcap", ReplayOptions(
        from_capsule=manifest["rollback_mcap"]["capsule_id"], capsule_dir=bags / "capsules"))
    assert verdict.identical and verdict.steps_compared == 2 * (N - K), (verdict.first_divergence, verdict.notes)
    assert verdict.fingerprint_replay == verdict.fingerprint_recorded, "the fixtures are stale: make_bags.py"
    assert (verdict.numerics_recorded, verdict.numerics_replay) == ("avx2", "avx2")
    events = replay_bag(bags / "events_sqlite3")
    assert events.identical and events.complete, (events.first_divergence, events.notes)


@pytest.mark.ros
def test_joint_states_with_empty_arrays_decode_from_the_bytes_the_rmw_serialises():
    """Fast DDS sizes a message's buffer with the alignment of every float64 sequence, empty
    ones included, but writes no padding for an empty one: a JointState with positions only
    arrives 8 bytes longer than its fields (more than the final alignment). The bag reader
    takes those bytes as the node does; bytes beyond what the sizing can leave are refused."""
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import JointState

    from capsule_ros.bag.typestore import build_typestore, deserialize
    store = build_typestore()
    spare = {}
    for velocity, effort in [(0, 0), (3, 0), (0, 3), (3, 3)]:
        msg = JointState(name=["a", "b", "c"], position=[0.5, -1.25, 2.0], velocity=[1.5] * velocity,
                         effort=[-0.75] * effort)
        raw = bytes(serialize_message(msg))
        decoded = deserialize(store, raw, "sensor_msgs/msg/JointState")
        assert list(decoded.name) == ["a", "b", "c"] and decoded.position.tolist() == [0.5, -1.25, 2.0]
        assert decoded.velocity.tolist() == [1.5] * velocity and decoded.effort.tolist() == [-0.75] * effort
        tight = len(store.serialize_cdr(decoded, "sensor_msgs/msg/JointState"))
        spare[velocity, effort] = len(raw) - tight
        with pytest.raises(ValueError, match="bytes after the last field"):
            deserialize(store, raw + bytes(8 + 4 * ((velocity == 0) + (effort == 0))), "sensor_msgs/msg/JointState")
    assert spare[0, 0] == 8 and spare[3, 3] == 0          # what made replays of such bags fail before


# -- recorder and scheduling, without ROS ----------------------------------------------------------------

def test_recorder_keeps_write_order_from_many_threads(tmp_path):
    from capsule_ros.bag.recorder import NodeRecorder
    from capsule_ros.serving.config import ServingConfig
    config = ServingConfig.from_file(REPO / "config" / "policy.yaml")
    recorder = NodeRecorder.start(str(tmp_path / "threads"), "", "mcap", config, "/capsule_policy/action",
                                  "/capsule_policy/capsule_events", fingerprint="f" * 64)
    with Recording(FIXTURES / "rollback_mcap") as fixture:
        raw = next(e.data for e in fixture.entries() if e.port == "goal")

    def writer(n):
        for _ in range(200):
            recorder.write_raw("arm/goal", "geometry_msgs/msg/PointStamped", raw, stamp_ns=1000)   # same stamp

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recorder.close() == 800 and recorder.close() == 800          # idempotent
    recorder.write_raw("arm/goal", "geometry_msgs/msg/PointStamped", raw, 5)   # after close: ignored
    with Recording(tmp_path / "threads") as recording:
        times = [e.time for e in recording.entries()]
        assert recording.meta.ports["goal"].topic == "/arm/goal"        # resolved in the node's namespace
    assert len(times) == 800 and times == sorted(set(times)) and times[0] == 1000
    from capsule_ros.bag.errors import RecordArgumentError, RecordError
    from capsule_ros.errors import ErrorCode
    with pytest.raises(RecordError) as exists:          # the node answers IO_ERROR
        NodeRecorder.start(str(tmp_path / "threads"), "", "mcap", config, "/a/action", "/a/capsule_events")
    assert exists.value.code == ErrorCode.IO_ERROR and "exists" in str(exists.value)
    with pytest.raises(RecordArgumentError) as storage:
        NodeRecorder.start("", str(tmp_path), "rosbag1", config, "/a/action", "/a/capsule_events")
    assert storage.value.code == ErrorCode.INVALID_ARGUMENT


def _event(kind, time, index, capsule_id="", step=0, episode=1, detail=""):
    return RecordedEvent(time, index, kind, capsule_id, "", episode, step, False, False, detail)


def test_commit_published_after_later_steps_applies_at_its_boundary():
    """commit snapshots at step 5, saves, and its event comes after steps 6 and 7."""
    scan = BagScan(actions=[ActionInfo(20 + 10 * s, 0, 1, s, "", 0) for s in range(1, 8)],
                        events=[_event(EventKind.COMMIT, 95, 0, "e1.s5.abcdef", step=7)])
    scan.trigger_times.extend(15 + 10 * s for s in range(1, 8))        # trigger 5 ms before each action
    (slot, _), = Scheduler(scan, "trigger").schedule()
    assert (slot.time, slot.side) == (75, BEFORE)                           # before the trigger of step 6


def test_interrupt_recorded_after_a_trigger_it_preceded_applies_before_that_step():
    actions = [ActionInfo(20, 0, 1, 1, "", 0), ActionInfo(40, 0, 1, 1, "", 1)]   # step 1, then a safe action
    scan = BagScan(actions=actions, events=[_event(EventKind.INTERRUPT, 35, 0, step=1, detail="HOLD_LAST")])
    scan.trigger_times.extend([15, 30])
    (slot, _), = Scheduler(scan, "trigger").schedule()
    assert (slot.time, slot.side) == (30, BEFORE)
    actions[1] = ActionInfo(40, 0, 1, 2, "", 0)                              # the step came first
    (slot, _), = Scheduler(scan, "trigger").schedule()
    assert (slot.time, slot.side) == (35, AT)


def test_reentry_after_a_silent_trigger_stays_after_it():
    """A trigger that made no action (interrupted, silent), then a re-entry, then a step:
    the re-entry must not move before the silent trigger."""
    actions = [ActionInfo(60, 0, 1, 6, "e1.s5.abcdef", 0)]
    scan = BagScan(actions=actions, events=[_event(EventKind.REENTER, 45, 0, "e1.s5.abcdef", step=5)])
    scan.trigger_times.extend([40, 55])
    (slot, _), = Scheduler(scan, "trigger").schedule()
    assert (slot.time, slot.side) == (45, AT)
    scan.trigger_times[:] = type(scan.trigger_times)("q", [40])     # the action is the trigger's at 40
    (slot, _), = Scheduler(scan, "trigger").schedule()
    assert (slot.time, slot.side) == (40, BEFORE)
