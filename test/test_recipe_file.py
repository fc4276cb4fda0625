"""Format version 2: a capsule file carries its recipe, and the fingerprint's parts.

- A recipe round-trips byte for byte, plain and encrypted; restoring skips it; a state
  section that is damaged or cut off still yields the verified recipe.
- A damaged recipe, a recipe chunk moved into the state section, a forged header and a
  forged recipe content (tags recomputed on a plain file) are refused (CorruptCapsule).
- The writer refuses a malformed recipe object (InvalidArgument), as a reader would.
- Files of format version 1 (``test/fixtures/format_v1``, written by the version 1 writer)
  still load, plain and encrypted, and carry no recipe; a version 1 header that claims one
  is refused.
- The fingerprint's formula is unchanged (the default policy's fingerprint equals the one
  of the version 1 capsule in ``test/fixtures/capsules``), and its parts name what changed:
  weights, architecture and state layout, port mapping, kernel, build.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.fileformat import (
    MAGIC,
    PREFIX,
    CapsuleHeader,
    canonical_json,
    read_capsule,
    read_header,
    read_recipe,
    verify_capsule,
    write_capsule,
)
from capsule_ros.capsules.recipe import Recipe, RecipeInfo, RecipeInput, RecipeRoot
from capsule_ros.errors import CapsuleRosError, CorruptCapsule, InvalidArgument
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, buffer_specs
from capsule_ros.runtime.fingerprint import FingerprintParts, describe_causes

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "test" / "fixtures"
FP = hashlib.sha256(b"test graph").hexdigest()
MAX = 1 << 20
CHUNK = 256
LAYOUT = ArenaLayout(buffer_specs([
    ("obs", (12,), torch.float32, BufferKind.INPUT),         # 48 bytes at 0: the input row is 48 bytes
    ("kv", (4, 64), torch.float32, BufferKind.KV),           # 1024 bytes at 256
    ("rec", (16,), torch.float32, BufferKind.RECURRENT),     # 64 bytes at 1280; arena 1536 bytes
]))
PARTS = FingerprintParts(*(hashlib.sha256(n.encode()).hexdigest() for n in ("a", "l", "w", "p")), "cpu")
V1_KEY = hashlib.sha256(b"capsule_ros test key of the version 1 fixture").digest()


def make_recipe(steps: int = 40, every: int = 3, action_dim: int = 2) -> Recipe:
    """A recipe of ``steps`` steps of which one in ``every`` read its inputs."""
    rng = np.random.default_rng(steps)
    reads = np.arange(steps) % every == 0
    inputs = (RecipeInput("obs", (12,), "float32", 0, hashlib.sha256(b"binding").hexdigest()),)
    info = RecipeInfo(True, "", RecipeRoot.initial(1, 0, (3, 1, 4)), 0, steps, int(reads.sum()), 48, action_dim,
                      inputs)
    rows = rng.integers(0, 256, size=(info.rows, 48), dtype=np.uint8)
    return Recipe(info, reads, rows, rng.normal(size=(steps, action_dim)).astype(np.float32))


def header(recipe, capsule_id: str = "e1.s40.abc123") -> CapsuleHeader:
    """A header at the step the recipe reaches."""
    info = recipe.info if isinstance(recipe, Recipe) else recipe
    return CapsuleHeader(capsule_id, "approach", "", 1, info.step, 1_700_000_000_000_000_000, LAYOUT.nbytes, FP,
                         LAYOUT.schema(), CHUNK, fingerprint_parts=PARTS, recipe=info)


STATE = hashlib.shake_256(b"state").digest(LAYOUT.nbytes)


def write(path: Path, recipe: Recipe, kek=None) -> bytes:
    with open(path, "wb") as f:
        write_capsule(f, header(recipe), STATE, kek, recipe=recipe.to_bytes())
    return path.read_bytes()


def sections(blob: bytes, encrypted: bool):
    """(head, recipe records, state records) of a version 2 file, by the format's rules."""
    _, version, _, json_len = PREFIX.unpack_from(blob)
    obj = json.loads(blob[PREFIX.size:PREFIX.size + json_len])
    tag, pos = (16 if encrypted else 32), PREFIX.size + json_len + 32
    head, out = blob[:pos], []
    for nbytes in (obj["recipe"]["nbytes"], obj["nbytes"]):
        records = []
        for start in range(0, nbytes, obj["chunk_bytes"]):
            n = min(obj["chunk_bytes"], nbytes - start) + tag
            records.append(blob[pos:pos + n])
            pos += n
        out.append(records)
    assert pos == len(blob) and version == 2
    return head, out[0], out[1]


def refused(call) -> bool:
    try:
        call()
    except CorruptCapsule:
        return True
    return False


def same_recipe(a: Recipe, b: Recipe) -> bool:
    return (a.info == b.info and np.array_equal(a.reads, b.reads) and np.array_equal(a.rows, b.rows)
            and a.actions.tobytes() == b.actions.tobytes())


# -- round trip ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encrypted", [False, True])
def test_recipe_round_trips_and_restoring_skips_it(tmp_path, encrypted):
    kek = os.urandom(32) if encrypted else None
    recipe = make_recipe()
    path = tmp_path / "r.capsule"
    write(path, recipe, kek)
    head, data = read_capsule(path, kek=kek, max_bytes=MAX, expected_fingerprint=FP)
    assert bytes(data.numpy()) == STATE and head.fingerprint_parts == PARTS and head.recipe == recipe.info
    got_header, got = read_recipe(path, kek=kek, max_bytes=MAX, max_recipe_bytes=MAX)
    assert got is not None and same_recipe(Recipe.from_bytes(got_header.recipe, got), recipe)
    assert verify_capsule(path, kek=kek, max_bytes=MAX).recipe == recipe.info
    assert read_header(path, max_bytes=MAX).recipe.describe().startswith("40 step(s) from the initial state")


def test_a_damaged_or_truncated_state_still_yields_the_recipe(tmp_path):
    recipe = make_recipe()
    path = tmp_path / "s.capsule"
    blob = write(path, recipe)
    head, recipe_records, state_records = sections(blob, False)
    state_start = len(head) + sum(map(len, recipe_records))
    for cut in range(state_start, len(blob), 97):                  # cut off inside the state section
        path.write_bytes(blob[:cut])
        assert refused(lambda: read_capsule(path, max_bytes=MAX))
        got = read_recipe(path, max_bytes=MAX, max_recipe_bytes=MAX)[1]
        assert got is not None and bytes(got) == recipe.to_bytes()
    damaged = bytearray(blob)
    damaged[state_start + 5] ^= 0x40                               # a bit of the state flipped
    path.write_bytes(bytes(damaged))
    assert refused(lambda: read_capsule(path, max_bytes=MAX))
    assert bytes(read_recipe(path, max_bytes=MAX, max_recipe_bytes=MAX)[1]) == recipe.to_bytes()


# -- damage and forgery --------------------------------------------------------------------------------
@pytest.mark.parametrize("encrypted", [False, True])
def test_damaged_moved_or_forged_recipes_are_refused(tmp_path, encrypted):
    kek = os.urandom(32) if encrypted else None
    recipe = make_recipe(steps=160, every=2)                       # several recipe chunks
    path = tmp_path / "f.capsule"
    blob = write(path, recipe, kek)
    head, recipe_records, state_records = sections(blob, encrypted)
    assert len(recipe_records) >= 3 and len(recipe_records[0]) == len(state_records[0])

    def reads_recipe() -> bool:
        return refused(lambda: read_recipe(path, kek=kek, max_bytes=MAX, max_recipe_bytes=MAX))

    def verifies() -> bool:
        return not refused(lambda: verify_capsule(path, kek=kek, max_bytes=MAX))

    recipe_end = len(head) + sum(map(len, recipe_records))
    for offset in range(len(head), recipe_end, 7):                 # bit flips across the recipe section
        damaged = bytearray(blob)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        assert reads_recipe() and not verifies(), f"a flip at byte {offset} of the recipe was accepted"
    for cut in range(len(head), recipe_end, 53):                   # cut off inside the recipe
        path.write_bytes(blob[:cut])
        assert reads_recipe()
    moved = {"recipe chunk 0 and state chunk 0 swapped": [state_records[0], *recipe_records[1:],
                                                          recipe_records[0], *state_records[1:]],
             "recipe chunks 1 and 2 swapped": [recipe_records[0], recipe_records[2], recipe_records[1],
                                               *recipe_records[3:], *state_records]}
    for name, records in moved.items():
        path.write_bytes(head + b"".join(records))
        assert reads_recipe() or refused(lambda: read_capsule(path, kek=kek, max_bytes=MAX)), name
        assert not verifies(), name
    # a forged header: the recipe claimed not regenerable (and its reason) with the digest recomputed
    _, _, flags, json_len = PREFIX.unpack_from(blob)
    obj = json.loads(blob[PREFIX.size:PREFIX.size + json_len])
    obj["recipe"]["root"]["seed"] = 99
    body = canonical_json(obj)
    prefix = PREFIX.pack(MAGIC, 2, flags, len(body)) + body
    path.write_bytes(prefix + hashlib.sha256(prefix).digest() + blob[len(head):])
    assert reads_recipe() and refused(lambda: read_capsule(path, kek=kek, max_bytes=MAX))
    path.write_bytes(blob)
    assert verifies() and not reads_recipe()


def test_forged_recipe_content_with_valid_tags_is_refused(tmp_path):
    """A plain file can be re-tagged by anyone: the content must still agree with its header."""
    recipe = make_recipe()
    forged = bytearray(recipe.to_bytes())
    forged[0] ^= 0x02                                              # one more step claims to read inputs
    path = tmp_path / "e1.s40.abc123.capsule"
    with open(path, "wb") as f:
        write_capsule(f, header(recipe), STATE, None, recipe=bytes(forged))
    directory = CapsuleDirectory(tmp_path, max_file_bytes=MAX, read_only=True)
    with pytest.raises(CorruptCapsule, match="steps read inputs"):
        directory.recipe("e1.s40.abc123", MAX)


@pytest.mark.parametrize("change, message", [
    ({"regenerable": True, "reason": "cut"}, "needs a root and no reason"),
    ({"regenerable": False, "reason": ""}, "must say why"),
    ({"nbytes": 12}, "its counts make"),
    ({"rows": 41}, "must be in [0, 40]"),
    ({"steps": 39, "rows": 13}, "the capsule is at step 40"),
    ({"inputs": [{"name": "obs", "shape": [13], "dtype": "float32", "offset": 0, "binding": "0" * 64}]},
     "exceed the 48-byte row"),
    ({"root": {"kind": "capsule", "episode": 1, "capsule_id": "../x", "fingerprint": FP}}, "malformed"),
    ({"root": {"kind": "initial", "episode": 1, "seed": 0, "prefix": [-1]}}, "non-negative"),
    ({"extra": 1}, "unexpected"),
])
def test_malformed_recipe_objects_are_refused(tmp_path, change, message):
    obj = {**make_recipe().info.to_json(), **change}
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        RecipeInfo.from_json(obj, InvalidArgument, step=40)
    with pytest.raises(CorruptCapsule):
        RecipeInfo.from_json(obj, step=40)


def test_a_cut_recipe_keeps_its_reason_and_no_section(tmp_path):
    info = RecipeInfo.cut("the recipe would take 80 MiB, over capsules.recipe_max_mb = 64",
                          RecipeRoot.initial(1, 0), 0, 7, 7, 48, 2)
    path = tmp_path / "c.capsule"
    with open(path, "wb") as f:
        write_capsule(f, header(info), STATE, None)
    head, data = read_recipe(path, max_bytes=MAX, max_recipe_bytes=MAX)
    assert data is None and head.recipe == info and head.recipe.nbytes == 0
    assert head.recipe.describe() == f"not regenerable: {info.reason}"
    with pytest.raises(InvalidArgument, match="recipe of capsule"), open(tmp_path / "x.capsule", "wb") as f:
        write_capsule(f, header(info), STATE, None, recipe=b"x")


# -- version 1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kek", [("v1-plain", None), ("v1-encrypted", V1_KEY)])
def test_format_version_1_files_still_load(name, kek):
    path = FIXTURES / "format_v1" / f"{name}.capsule"
    head, data = read_capsule(path, kek=kek, max_bytes=MAX)
    assert head.version == 1 and head.recipe is None and head.fingerprint_parts is None
    assert bytes(data.numpy()) == hashlib.shake_256(b"format version 1").digest(head.nbytes)
    assert verify_capsule(path, kek=kek, max_bytes=MAX).capsule_id == "e1.s7.v1f1x7"
    assert read_recipe(path, kek=kek, max_bytes=MAX, max_recipe_bytes=MAX)[1] is None


def test_a_version_1_header_cannot_claim_a_recipe(tmp_path):
    blob = (FIXTURES / "format_v1" / "v1-plain.capsule").read_bytes()
    _, _, flags, json_len = PREFIX.unpack_from(blob)
    obj = json.loads(blob[PREFIX.size:PREFIX.size + json_len])
    obj["fingerprint_parts"] = PARTS.to_json()
    body = canonical_json(obj)
    prefix = PREFIX.pack(MAGIC, 1, flags, len(body)) + body
    path = tmp_path / "v1.capsule"
    path.write_bytes(prefix + hashlib.sha256(prefix).digest() + blob[PREFIX.size + json_len + 32:])
    with pytest.raises(CorruptCapsule, match="unexpected"):
        read_header(path, max_bytes=MAX)


# -- the fingerprint and its parts --------------------------------------------------------------------------
def test_fingerprint_formula_unchanged_and_parts_name_the_cause(tmp_path):
    from runtime_fixtures import default_config

    from capsule_ros.runtime.builder import runtime_identity
    from capsule_ros.serving.factory import build_policy, port_bindings
    config = default_config(tmp_path)                 # random weights from init_seed 0, as the fixture's node had
    fixture = read_header(next((FIXTURES / "capsules").glob("*.capsule")), max_bytes=1 << 30)

    def identity(cfg, policy=None):
        made = runtime_identity(policy or build_policy(cfg), cfg.runtime, port_bindings(cfg))
        return made.fingerprint, made.parts

    fingerprint, parts = identity(config)
    assert fingerprint == fixture.fingerprint, "the fingerprint formula changed: capsules of before would not load"
    policy = build_policy(config)
    with torch.no_grad():
        next(policy.parameters()).add_(1e-3)
    hybrid = config.policy_settings
    wider = dataclasses.replace(config, policy_settings=dataclasses.replace(hybrid, max_context=128))
    ports = dict(config.ports)
    ports["joints"] = dataclasses.replace(ports["joints"], fields=("velocity", "position"))
    remapped = dataclasses.replace(config, ports=ports)
    cases = {"weights": identity(config, policy), "architecture, state layout": identity(wider),
             "port mapping": identity(remapped)}
    for expected, (other_fp, other_parts) in cases.items():
        assert other_fp != fingerprint and describe_causes(parts.causes(other_parts)) == expected, expected
    kernel = dataclasses.replace(parts, kernel="cuda:sm_90")
    assert parts.causes(kernel) == ("kernel",)
    assert parts.causes(dataclasses.replace(parts, version=3)) == ("build",)
    assert parts.causes(parts) == ("build",)        # equal parts, yet the fingerprints differ: a build matter
    assert FingerprintParts.from_json(json.loads(json.dumps(parts.to_json()))) == parts
    with pytest.raises(CapsuleRosError):
        FingerprintParts.from_json({**parts.to_json(), "weights": "nothex"})
