"""A bag with topics the replayer does not read still verifies, but never silently: the
verdict, its JSON and the CLI's table list every ignored topic with its type and count."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from cpu_references import bag_fixtures
from harness import REPO
from rosbags.rosbag2 import StoragePlugin, Writer

from capsule_ros.bag.reader import Recording
from capsule_ros.bag.replay import replay_bag

EXTRA = {"/fixture/arm/camera/label": 3, "/rosout_copy": 2}     # topic -> messages added beside the recording


def with_extra_topics(src: Path, dst: Path) -> None:
    """A copy of ``src`` with ``EXTRA`` topics (std_msgs/String) between its messages, its
    capsule_ros metadata kept as recorded: what ``ros2 bag record -a`` or a merge gives."""
    custom = yaml.safe_load((src / "metadata.yaml").read_text())["rosbag2_bagfile_information"]["custom_data"]
    with Recording(src) as recording:
        store = recording.typestore
        writer = Writer(dst, version=Writer.VERSION_LATEST, storage_plugin=StoragePlugin.MCAP)
        writer.open()
        own = {}
        extra = {topic: writer.add_connection(topic, "std_msgs/msg/String", typestore=store) for topic in EXTRA}
        left = dict(EXTRA)
        for entry in recording.entries():
            if entry.topic not in own:
                own[entry.topic] = writer.add_connection(entry.topic, entry.msgtype, typestore=store)
            writer.write(own[entry.topic], entry.time, entry.data)
            for topic, conn in extra.items():
                if left[topic] and entry.index % 7 == 3:
                    left[topic] -= 1
                    msg = store.types["std_msgs/msg/String"](data=f"not ours {entry.index}")
                    writer.write(conn, entry.time + 1 + len(left), store.serialize_cdr(msg, "std_msgs/msg/String"))
        for key, value in custom.items():
            writer.set_custom_data(key, value)
        writer.close()
    assert not any(left.values())


def test_extra_topics_are_listed_by_the_verdict_and_the_cli(tmp_path):
    bag = tmp_path / "with_extra"
    with_extra_topics(bag_fixtures() / "events_sqlite3", bag)
    verdict = replay_bag(bag)
    assert verdict.identical and verdict.complete, (verdict.first_divergence, verdict.notes)
    assert verdict.topics_ignored == [f"{topic} (std_msgs/msg/String, {n} message{'s' if n > 1 else ''})"
                                      for topic, n in sorted(EXTRA.items())]
    assert replay_bag(bag_fixtures() / "events_sqlite3").topics_ignored == []          # the recording itself: none

    cli = [sys.executable, "-m", "capsule_ros.cli.main", "replay", str(bag), "--verify"]
    table = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if "topic ignored" in line]
    assert "2 topic(s) of the bag not replayed" in " ".join(table.stdout.split())
    assert len(rows) == 2 and "/fixture/arm/camera/label" in rows[0] and "/rosout_copy" in rows[1], table.stdout
    as_json = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert json.loads(as_json.stdout)["topics_ignored"] == verdict.topics_ignored
