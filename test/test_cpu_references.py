"""``cpu_references``: which recorded bits a test compares with on this CPU (a class with
recordings of its own takes those, any other the committed ones)."""
from __future__ import annotations

import re

from cpu_references import bag_fixtures, cpu_class, recorded

from capsule_ros.runtime import numerics


def test_the_cpu_class_names_the_level_and_is_the_same_each_time():
    cpu_class.cache_clear()
    first = cpu_class()
    cpu_class.cache_clear()
    assert cpu_class() == first                      # seeded kernels at a pinned level: the same bits again
    assert re.fullmatch(r"[a-z0-9]+-[0-9a-f]{16}", first) and first.startswith(numerics.resolve(numerics.PORTABLE))


def test_a_recording_of_this_cpus_class_is_taken_before_the_committed_one(tmp_path):
    (tmp_path / "outputs.npz").write_bytes(b"committed")
    assert recorded(tmp_path, "outputs.npz") == tmp_path / "outputs.npz"
    other = tmp_path / "cpu" / "avx2-0000000000000000"
    other.mkdir(parents=True)
    (other / "outputs.npz").write_bytes(b"another class")
    assert recorded(tmp_path, "outputs.npz") == tmp_path / "outputs.npz"          # not this CPU's class
    mine = tmp_path / "cpu" / cpu_class()
    mine.mkdir()
    (mine / "outputs.npz").write_bytes(b"this class")
    assert recorded(tmp_path, "outputs.npz").read_bytes() == b"this class"
    assert (bag_fixtures() / "manifest.json").exists()
