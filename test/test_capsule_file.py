"""The on-disk capsule format, the capsule directory and ``capsule-ros inspect``.

Every test asserts what its name says and prints its figure (run with ``-s``). The file
is sized for CI on 2 cores: well under 3 minutes in all, the Hypothesis fuzz ~45 s.
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import random
import stat
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.fileformat import (
    MAGIC,
    PREFIX,
    CapsuleHeader,
    canonical_json,
    load_kek,
    read_capsule,
    read_header,
    verify_capsule,
    write_capsule,
)
from capsule_ros.capsules.store import Capsule, CapsuleStoreConfig
from capsule_ros.errors import (
    CapsuleRosError,
    CorruptCapsule,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from capsule_ros.runtime.arena import ArenaLayout, BufferKind, buffer_specs

REPO = Path(__file__).resolve().parents[1]
FP = hashlib.sha256(b"test graph").hexdigest()
OTHER_FP = hashlib.sha256(b"another graph").hexdigest()
MAX = 1 << 20
CHUNK = 1024
LAYOUT = ArenaLayout(buffer_specs([
    ("kv", (4, 256), torch.float32, BufferKind.KV),          # 4096 bytes at 0
    ("rec", (16,), torch.float32, BufferKind.RECURRENT),     # 64 bytes at 4096
    ("conv", (1700,), torch.uint8, BufferKind.CONV),         # 1700 bytes at 4352; arena 6144 bytes
]))


# -- helpers ---------------------------------------------------------------------------------------
def make_header(capsule_id: str = "e1.s7.abc123", nbytes: int = LAYOUT.nbytes, chunk: int = CHUNK,
                schema=None) -> CapsuleHeader:
    return CapsuleHeader(capsule_id, "approach", "e1.s0.000000", 1, 7, 1_700_000_000_000_000_000, nbytes, FP,
                         LAYOUT.schema() if schema is None else schema, chunk)


def payload_for(name: str, nbytes: int = LAYOUT.nbytes) -> bytes:
    return hashlib.shake_256(name.encode()).digest(nbytes)


def capsule_bytes(tmp_path: Path, kek=None, capsule_id: str = "e1.s7.abc123", data: bytes = None) -> bytes:
    path = tmp_path / f"{capsule_id}.{'enc' if kek else 'plain'}.capsule"
    with open(path, "wb") as f:
        write_capsule(f, make_header(capsule_id), payload_for(capsule_id) if data is None else data, kek)
    return path.read_bytes()


def records(blob: bytes):
    """Split a capsule file into (header part, [chunk record ...]) as the format defines them."""
    _, _, flags, json_len = PREFIX.unpack_from(blob)
    head_end = PREFIX.size + json_len + 32
    header = json.loads(blob[PREFIX.size:PREFIX.size + json_len])
    tag = 16 if flags & 1 else 32
    out, pos = [], head_end
    for i in range(header["chunk_count"]):
        n = min(header["chunk_bytes"], header["nbytes"] - i * header["chunk_bytes"]) + tag
        out.append(blob[pos:pos + n])
        pos += n
    assert pos == len(blob)
    return blob[:head_end], out


def forge(obj, flags: int = 0, tail: bytes = b"") -> bytes:
    """A file with an arbitrary header object and a correct header digest (what anyone can
    compute for a plain capsule): only validation stands between it and the loader."""
    body = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    prefix = PREFIX.pack(MAGIC, 1, flags, len(body)) + body
    return prefix + hashlib.sha256(prefix).digest() + tail


def refusal(path: Path, **kwargs):
    """The typed error read_capsule raises, or None when it accepts the file."""
    try:
        read_capsule(path, max_bytes=kwargs.pop("max_bytes", MAX), **kwargs)
    except CapsuleRosError as exc:
        return exc
    return None


def child_env() -> dict:
    """This interpreter's environment with the repository first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


@pytest.fixture()
def kek():
    return os.urandom(32)


# -- round trip ------------------------------------------------------------------------------------
@pytest.mark.parametrize("encrypted", [False, True])
def test_round_trip_is_byte_exact(tmp_path, kek, encrypted):
    key = kek if encrypted else None
    blob = capsule_bytes(tmp_path, key)
    path = tmp_path / "x.capsule"
    path.write_bytes(blob)
    header, data = read_capsule(path, kek=key, max_bytes=MAX, expected_fingerprint=FP,
                                expected_schema=LAYOUT.schema())
    assert data.dtype == torch.uint8 and bytes(data.numpy()) == payload_for("e1.s7.abc123")
    assert header.encrypted == encrypted and header.chunk_count == 6 and header.schema_dicts() == LAYOUT.schema()
    assert verify_capsule(path, kek=key, max_bytes=MAX) == header == read_header(path, max_bytes=MAX)
    assert len(blob) == header.file_bytes()
    if encrypted:
        assert payload_for("e1.s7.abc123")[:64] not in blob
    print(f"round trip ({'encrypted' if encrypted else 'plain'}): {len(blob)} bytes on disk for "
          f"{header.nbytes} payload bytes in {header.chunk_count} chunks, byte-exact")


def test_writer_refuses_bad_headers_and_payloads():
    bad = {
        "payload length": (make_header(), b"\0" * 10),
        "fingerprint": (CapsuleHeader("a", "", "", 0, 0, 0, 6144, "XYZ", [], CHUNK), bytes(6144)),
        "overlap": (make_header(schema=[dict(LAYOUT.schema()[0]), dict(LAYOUT.schema()[0], name="b")]),
                    bytes(6144)),
        "chunk size": (make_header(chunk=7), bytes(6144)),
        "chunk size 0": (make_header(chunk=0), bytes(6144)),
        "nbytes None": (make_header(nbytes=None), bytes(6144)),
        "numpy int step": (CapsuleHeader("a", "", "", 0, numpy.int64(3), 0, 6144, FP, [], CHUNK), bytes(6144)),
        "id": (make_header(capsule_id="../x"), bytes(6144)),
    }
    refused = 0
    for header, data in bad.values():
        with pytest.raises(InvalidArgument):
            write_capsule(io.BytesIO(), header, data, None)
        refused += 1
    with pytest.raises(InvalidArgument):
        write_capsule(io.BytesIO(), make_header(), bytes(6144), b"short key")
    print(f"writer: {refused + 1}/{len(bad) + 1} malformed headers / payloads / keys refused with InvalidArgument")


# -- damage ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("encrypted", [False, True])
def test_truncation_at_every_offset_is_refused(tmp_path, kek, encrypted):
    key = kek if encrypted else None
    blob = capsule_bytes(tmp_path, key)
    assert len(blob) >= 2000 and len(records(blob)[1]) >= 4
    path = tmp_path / "t.capsule"
    refused = 0
    for size in range(len(blob)):
        path.write_bytes(blob[:size])
        refused += isinstance(refusal(path, kek=key), CorruptCapsule)
    print(f"truncation ({'encrypted' if encrypted else 'plain'}): {refused}/{len(blob)} offsets refused "
          "with CorruptCapsule")
    assert refused == len(blob)


@pytest.mark.parametrize("encrypted,flips", [(False, 10_000), (True, 2_000)])
def test_random_single_bit_flips_are_refused(tmp_path, kek, encrypted, flips):
    key = kek if encrypted else None
    blob = capsule_bytes(tmp_path, key)
    rng = random.Random(20261130 + encrypted)
    path = tmp_path / "f.capsule"
    refused, where = 0, collections.Counter()
    head_end = len(records(blob)[0])
    for _ in range(flips):
        bit = rng.randrange(len(blob) * 8)
        damaged = bytearray(blob)
        damaged[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(damaged)
        if isinstance(refusal(path, kek=key), CorruptCapsule):
            refused += 1
            where["header" if bit // 8 < head_end else "payload"] += 1
    print(f"bit flips ({'encrypted' if encrypted else 'plain'}): {refused}/{flips} refused "
          f"({where['header']} in the header, {where['payload']} in chunks)")
    assert refused == flips


def test_wrong_key_missing_key_and_downgrade_are_refused(tmp_path, kek):
    enc, plain = tmp_path / "enc.capsule", tmp_path / "plain.capsule"
    enc.write_bytes(capsule_bytes(tmp_path, kek))
    plain.write_bytes(capsule_bytes(tmp_path))
    wrong = refusal(enc, kek=os.urandom(32))
    assert isinstance(wrong, CorruptCapsule) and "wrong key or corrupted" in str(wrong)
    assert isinstance(refusal(enc), PermissionDenied)                    # encrypted, no key
    assert isinstance(refusal(plain, kek=kek), CorruptCapsule)           # key configured, file unauthenticated
    assert isinstance(refusal(enc, kek=b"x" * 31), InvalidArgument)
    print(f"keys: wrong key -> {type(wrong).__name__} ({wrong}); no key -> PermissionDenied; "
          "plain file under a key -> CorruptCapsule")


def test_foreign_fingerprint_and_schema_are_refused(tmp_path):
    path = tmp_path / "x.capsule"
    path.write_bytes(capsule_bytes(tmp_path))
    other_schema = [dict(LAYOUT.schema()[0], dtype="int32")] + LAYOUT.schema()[1:]
    errors = [refusal(path, expected_fingerprint=OTHER_FP), refusal(path, expected_schema=other_schema),
              refusal(path, expected_schema=LAYOUT.schema()[:2])]
    assert all(isinstance(e, FingerprintMismatch) for e in errors), errors
    assert refusal(path, expected_fingerprint=FP, expected_schema=LAYOUT.schema()) is None
    print(f"fingerprint: {len(errors)}/{len(errors)} foreign fingerprint / schema refused with FingerprintMismatch")


@pytest.mark.parametrize("encrypted", [False, True])
def test_dropped_duplicated_reordered_spliced_chunks_and_trailing_bytes_are_refused(tmp_path, kek, encrypted):
    key = kek if encrypted else None
    head, recs = records(capsule_bytes(tmp_path, key))
    _, foreign = records(capsule_bytes(tmp_path, key, data=payload_for("other")))
    cases = {
        "dropped chunk 2": recs[:2] + recs[3:],
        "dropped last chunk": recs[:-1],
        "duplicated chunk 2 (inserted)": recs[:3] + recs[2:],
        "duplicated chunk 2 (over chunk 1)": recs[:1] + [recs[2]] + recs[2:],
        "swapped chunks 1 and 2": recs[:1] + [recs[2], recs[1]] + recs[3:],
        "last chunk moved to the front": [recs[-1]] + recs[:-1],
        "chunk 3 spliced from another capsule": recs[:3] + [foreign[3]] + recs[4:],
        "1 trailing byte": recs + [b"\0"],
        "1000 trailing bytes": recs + [os.urandom(1000)],
    }
    path = tmp_path / "c.capsule"
    refused = []
    for name, parts in cases.items():
        path.write_bytes(head + b"".join(parts))
        if isinstance(refusal(path, kek=key), CorruptCapsule):
            refused.append(name)
    path.write_bytes(head + b"".join(recs))
    assert refusal(path, kek=key) is None
    print(f"chunk records ({'encrypted' if encrypted else 'plain'}): {len(refused)}/{len(cases)} refused: "
          + "; ".join(refused))
    assert len(refused) == len(cases)


# -- bounded reads and fuzz ------------------------------------------------------------------------
def _valid_obj() -> dict:
    return json.loads(canonical_json(make_header().to_json()))


def test_absurd_sizes_are_refused_before_allocating(tmp_path):
    path = tmp_path / "huge.capsule"
    cases = {
        "nbytes 1 TiB": dict(nbytes=1 << 40, chunk_count=(1 << 40) // CHUNK, schema=[]),
        "nbytes above max_bytes": dict(nbytes=(1 << 41) + 1, chunk_count=((1 << 41) + CHUNK) // CHUNK, schema=[]),
        "64 MiB chunk, huge count": dict(nbytes=1 << 40, chunk_bytes=64 << 20, chunk_count=1 << 14, schema=[]),
        "huge buffer shape": dict(schema=[dict(LAYOUT.schema()[0], shape=[1 << 40, 1 << 40], nbytes=1 << 82)]),
        "4097 buffers": dict(schema=[dict(LAYOUT.schema()[1], name=f"b{i}", offset=i * 256) for i in range(4097)],
                             nbytes=4097 * 256, chunk_count=4097 // 4 + 1),
        "4096 buffers, nbytes 1 TiB": dict(
            schema=[dict(LAYOUT.schema()[1], name=f"b{i}", offset=i * 256) for i in range(4096)],
            nbytes=1 << 40, chunk_count=(1 << 40) // CHUNK),
        "header JSON over 1 MiB": dict(label="x" * (1 << 20)),
    }
    tracemalloc.start()
    peaks = []
    try:
        for name, change in cases.items():
            path.write_bytes(forge({**_valid_obj(), **change}, tail=os.urandom(4096)))
            tracemalloc.reset_peak()
            error = refusal(path, max_bytes=1 << 41)
            peaks.append(tracemalloc.get_traced_memory()[1])
            assert isinstance(error, CorruptCapsule), (name, error)
    finally:
        tracemalloc.stop()
    print(f"absurd sizes: {len(cases)}/{len(cases)} refused with CorruptCapsule ({'; '.join(cases)}); "
          f"peak traced allocation {max(peaks) / 2**20:.1f} MiB for headers claiming up to 1 TiB")
    assert max(peaks) < 16 << 20


def _fuzz(name: str, strategy, check, max_examples: int) -> None:
    """Run ``check(data)`` over ``strategy``; only typed errors may escape the reader, and
    the traced allocation peak must stay bounded by the input size."""
    stats = collections.Counter()
    peaks = [0]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(strategy)
    def run(data):
        tracemalloc.start()           # traced around the read only: tracing Hypothesis would triple the time
        try:
            outcome = check(data)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= 16 * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte file"
        peaks[0] = max(peaks[0], peak)
        stats[outcome] += 1

    start = time.perf_counter()
    run()
    print(f"fuzz {name}: {sum(stats.values())} inputs in {time.perf_counter() - start:.1f} s, outcomes "
          f"{dict(stats.most_common())}; max traced allocation {peaks[0] / 1024:.0f} KiB "
          "(bound: 16 x file size + 1 MiB)")


def _reader(path: Path, kek=None):
    """A check: write the input, read it; returns the outcome name (typed errors only)."""
    def check(data: bytes) -> str:
        path.write_bytes(data)
        try:
            read_capsule(path, kek=kek, max_bytes=1 << 40)
        except CapsuleRosError as exc:
            return type(exc).__name__
        return "accepted"
    return check


def test_fuzz_random_bytes(tmp_path):
    heads = st.sampled_from([b"", MAGIC, MAGIC + struct.pack("<HH", 1, 0), MAGIC + struct.pack("<HH", 1, 1)])
    strategy = st.tuples(heads, st.binary(max_size=4096)).map(lambda t: t[0] + t[1])
    check = _reader(tmp_path / "r.capsule")

    def refused(data):
        outcome = check(data)
        assert outcome != "accepted"
        return outcome
    _fuzz("random bytes", strategy, refused, max_examples=6000)


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 64)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
)


def _mutate(blob: bytes, mutations) -> bytes:
    out = bytearray(blob)
    for m in mutations:
        pos = m[1] % (len(out) + 1) if isinstance(m[1], int) else 0
        if m[0] == "flip" and out:
            out[pos % len(out)] ^= 1 << m[2]
        elif m[0] == "set" and out:
            out[pos % len(out)] = m[2]
        elif m[0] == "delete":
            del out[pos:pos + m[2]]
        elif m[0] == "insert":
            out[pos:pos] = m[2]
        elif m[0] == "truncate":
            del out[pos:]
        elif m[0] == "append":
            out += m[1]
    return bytes(out)


@pytest.mark.parametrize("encrypted", [False, True])
def test_fuzz_mutated_valid_files(tmp_path, kek, encrypted):
    key = kek if encrypted else None
    blob = capsule_bytes(tmp_path, key)
    check = _reader(tmp_path / "m.capsule", key)

    def any_change_refused(mutated: bytes) -> str:
        outcome = check(mutated)
        assert (outcome == "accepted") == (mutated == blob), outcome
        return "no-op mutation, accepted" if outcome == "accepted" else outcome
    strategy = st.lists(_MUTATION, min_size=1, max_size=4).map(lambda ms: _mutate(blob, ms))
    _fuzz(f"mutated {'encrypted' if encrypted else 'plain'} files", strategy, any_change_refused,
          max_examples=3500)


_ABSURD = st.one_of(
    st.integers(-(1 << 70), 1 << 70), st.sampled_from([0, -1, 1 << 31, 1 << 32, 1 << 40, 1 << 63, 1 << 64]),
    st.booleans(), st.none(), st.floats(allow_nan=False), st.text(max_size=300),
    st.lists(st.integers(-(1 << 65), 1 << 65), max_size=20), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                            max_size=3))
_HEADER_KEYS = sorted(_valid_obj()) + ["wrapped_key", "extra"]
_BUFFER_KEYS = ["name", "shape", "dtype", "kind", "offset", "nbytes"]


@st.composite
def _absurd_headers(draw) -> bytes:
    obj = _valid_obj()
    for _ in range(draw(st.integers(1, 4))):
        target = draw(st.sampled_from(["header", "buffer", "many buffers"]))
        if target == "header":
            obj[draw(st.sampled_from(_HEADER_KEYS))] = draw(_ABSURD)
        elif target == "buffer" and isinstance(obj.get("schema"), list) and obj["schema"]:
            entry = obj["schema"][draw(st.integers(0, len(obj["schema"]) - 1))]
            if isinstance(entry, dict):
                entry[draw(st.sampled_from(_BUFFER_KEYS))] = draw(_ABSURD)
        else:
            count = draw(st.sampled_from([2, 64, 300]))     # 4096 / 4097+ are in test_absurd_sizes
            obj["schema"] = [dict(LAYOUT.schema()[0], name=f"b{i}", offset=i * 4096) for i in range(count)]
            obj["nbytes"] = draw(st.sampled_from([count * 4096, 1 << 40]))
            obj["chunk_count"] = -(-obj["nbytes"] // CHUNK)
    flags = draw(st.sampled_from([0, 0, 1]))
    tail = draw(st.sampled_from([b"", os.urandom(64), os.urandom(6144 + 6 * 32), os.urandom(6144 + 6 * 16)]))
    return forge(obj, flags, tail)


def test_fuzz_forged_headers_with_absurd_values(tmp_path, kek):
    checks = (_reader(tmp_path / "h.capsule"), _reader(tmp_path / "h.capsule", kek))

    def refused(data: bytes) -> str:
        outcome = checks[PREFIX.unpack_from(data)[2] & 1](data)
        assert outcome != "accepted"
        return outcome
    _fuzz("forged headers with absurd values", _absurd_headers(), refused, max_examples=2500)


# -- crash injection -------------------------------------------------------------------------------
# The spawner imports once, then forks writer processes and SIGKILLs each at a random
# moment (a writer's loop: BEGIN id, CapsuleDirectory.save, SAVED id, written unbuffered
# to a pipe the spawner forwards). It stops once `target` saves have been attempted.
SPAWNER = r"""
import hashlib, os, random, select, signal, sys, time
from capsule_ros.capsules.directory import CapsuleDirectory
from capsule_ros.capsules.store import Capsule, CapsuleStoreConfig

root, target, seed, fp, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rng = random.Random(seed)

def writer(round_, out):
    try:
        directory = CapsuleDirectory(root, chunk_bytes=16384, max_file_bytes=1 << 20)
        os.write(out, f"RECOVERED {len(directory.recovered)}\n".encode())
        i = 0
        while True:
            cid = f"shared-{i % 3}" if i % 4 == 3 else f"r{round_}-{i}"
            os.write(out, f"BEGIN {cid}\n".encode())
            data = hashlib.shake_256(cid.encode()).digest(nbytes)
            directory.save(Capsule(cid, "crash", "", round_, i, nbytes, fp, time.time_ns()), data, [])
            os.write(out, f"SAVED {cid}\n".encode())
            i += 1
    except BaseException as exc:
        os.write(out, f"ERROR {exc!r}\n".encode())
    os._exit(1)

attempts = round_ = 0
while attempts < target:
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        writer(round_, wr)
    os.close(wr)
    with os.fdopen(rd, "rb") as pipe:
        first = pipe.readline()                     # RECOVERED n: the writer is running
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        lines = [first] + pipe.readlines()
    text = b"".join(lines).decode()
    attempts += text.count("BEGIN ")
    sys.stdout.write(text + f"KILLED {round_}\n")
    sys.stdout.flush()
    round_ += 1
print("DONE", flush=True)
"""


def test_crash_injection_leaves_only_complete_capsules(tmp_path):
    root, nbytes = tmp_path / "capsules", 64 * 1024
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", SPAWNER, str(root), "200", "1130", FP, str(nbytes)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith("ERROR")], [ln for ln in lines if ln.startswith("ERROR")]
    attempted = sum(ln.startswith("BEGIN ") for ln in lines)
    saved = {ln.split()[1] for ln in lines if ln.startswith("SAVED ")}
    kills = sum(ln.startswith("KILLED ") for ln in lines)
    recovered_by_writers = sum(int(ln.split()[1]) for ln in lines if ln.startswith("RECOVERED "))
    leftovers = sorted(p.name for p in root.glob("*.part"))

    directory = CapsuleDirectory(root, chunk_bytes=16384, max_file_bytes=1 << 20)
    assert len(directory.recovered) == len(leftovers) and not list(root.glob("*.part"))
    quarantined = sorted((root / "quarantine").glob("*")) if (root / "quarantine").exists() else []
    assert len(quarantined) == recovered_by_writers + len(leftovers)

    loaded, bad = 0, []
    for capsule_id in directory.ids():
        try:
            capsule, data = directory.load(capsule_id, expected_fingerprint=FP)
            assert bytes(data.numpy()) == hashlib.shake_256(capsule_id.encode()).digest(nbytes)
            verify_capsule(directory.path_of(capsule_id), max_bytes=1 << 20)
            loaded += 1
        except CapsuleRosError as exc:
            bad.append((capsule_id, exc))
    lost = sorted(saved - set(directory.ids()))
    complete_parts = sum(refusal(p) is None for p in quarantined)
    print(f"crash injection: {kills} SIGKILLs, {attempted} saves attempted, {len(saved)} confirmed SAVED; "
          f"{loaded}/{len(directory.ids())} capsule files load and verify ({len(bad)} partial loadable), "
          f"{len(lost)} confirmed saves lost; {len(quarantined)} .part leftovers quarantined "
          f"({complete_parts} complete: killed between fsync and rename)")
    assert attempted >= 200 and kills >= 5
    assert not bad and not lost and loaded == len(directory.ids())


# -- permissions and confinement -------------------------------------------------------------------
def test_permissions_and_confinement(tmp_path, kek):
    root = tmp_path / "caps"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    key_file = tmp_path / "kek"
    key_file.write_bytes(kek)
    os.chmod(key_file, 0o600)
    old_umask = os.umask(0)                      # the modes must not depend on the caller's umask
    try:
        directory = CapsuleDirectory(root, key_file=str(key_file), chunk_bytes=CHUNK, max_file_bytes=MAX)
        capsule = Capsule("e1.s7.abc123", "x", "", 1, 7, LAYOUT.nbytes, FP, time.time_ns())
        path = directory.save(capsule, torch.frombuffer(bytearray(payload_for("p")), dtype=torch.uint8),
                              LAYOUT.schema())
    finally:
        os.umask(old_umask)
    modes = (stat.S_IMODE(os.stat(root).st_mode), stat.S_IMODE(os.stat(path).st_mode))
    assert modes == (0o700, 0o600)
    loaded, data = directory.load("e1.s7.abc123", expected_fingerprint=FP, expected_schema=LAYOUT.schema())
    assert bytes(data.numpy()) == payload_for("p") and loaded.path == str(path) and loaded.payload is None
    assert directory.header("e1.s7.abc123").encrypted and directory.ids() == ["e1.s7.abc123"]
    with pytest.raises(FingerprintMismatch):
        directory.load("e1.s7.abc123", expected_fingerprint=OTHER_FP)

    key_modes = [0o644, 0o640, 0o604, 0o660, 0o602]
    for mode in key_modes:
        os.chmod(key_file, mode)
        with pytest.raises(PermissionDenied):
            load_kek(key_file)
        with pytest.raises(PermissionDenied):
            CapsuleDirectory(root, key_file=str(key_file), max_file_bytes=MAX)
    os.chmod(key_file, 0o400)
    assert load_kek(key_file) == kek
    short = tmp_path / "short"
    short.write_bytes(b"k" * 16)
    os.chmod(short, 0o600)
    with pytest.raises(InvalidArgument):
        load_kek(short)

    evil = ["../x", "a/b", ".hidden", "", "..", "a..b", "/etc/passwd", "x" * 129, "a\0b", "-x", "é"]
    refused = 0
    for bad in evil:
        for call in (directory.path_of, directory.exists, directory.remove, directory.header,
                     lambda i: directory.load(i, expected_fingerprint=FP),
                     lambda i: directory.save(Capsule(i, "", "", 0, 0, 6144, FP, 0), bytes(6144), [])):
            with pytest.raises(InvalidArgument):
                call(bad)
            refused += 1
    (tmp_path / "elsewhere.capsule").write_bytes(path.read_bytes())
    (root / "escape.capsule").symlink_to(tmp_path / "elsewhere.capsule")
    assert not directory.exists("escape")
    with pytest.raises(CorruptCapsule, match="symbolic link"):
        directory.load("escape", expected_fingerprint=FP)
    with pytest.raises(CorruptCapsule, match="symbolic link"):
        directory.describe("escape")
    with pytest.raises(NotFound):
        directory.load("absent", expected_fingerprint=FP)
    directory.remove("e1.s7.abc123")
    assert directory.ids() == [] and not path.exists()
    print(f"permissions: directory {modes[0]:#o}, file {modes[1]:#o} under umask 0; key modes "
          f"{[oct(m) for m in key_modes]} refused with PermissionDenied; {refused} calls with "
          f"{len(evil)} traversal / malformed ids refused with InvalidArgument; symlink escape refused")


def test_directory_from_config_round_trip_and_renamed_file(tmp_path):
    config = CapsuleStoreConfig(directory=str(tmp_path / "from_config"), chunk_mb=0.0625, max_file_mb=1.0)
    directory = CapsuleDirectory.from_config(config)
    assert directory.chunk_bytes == 64 * 1024 and directory.max_file_bytes == 1 << 20 and not directory.encrypted
    capsule = Capsule("e2.s5.cafe01", "lbl", "e2.s0.000000", numpy.int64(2), numpy.int64(5), LAYOUT.nbytes, FP, 42)
    directory.save(capsule, payload_for("d"), LAYOUT.schema())
    loaded, data = directory.load(capsule.id, expected_fingerprint=FP)
    assert (loaded.id, loaded.label, loaded.parent_id, loaded.episode_id, loaded.step, loaded.stamp_ns) == \
        ("e2.s5.cafe01", "lbl", "e2.s0.000000", 2, 5, 42) and bytes(data.numpy()) == payload_for("d")
    os.rename(directory.path_of(capsule.id), directory.path_of("renamed"))
    with pytest.raises(CorruptCapsule, match="holds capsule"):
        directory.load("renamed", expected_fingerprint=FP)
    with pytest.raises(InvalidArgument):
        CapsuleDirectory.from_config(CapsuleStoreConfig(directory=""))
    with pytest.raises(InvalidArgument):
        CapsuleDirectory(tmp_path / "big", chunk_bytes=128 << 20, max_file_bytes=1 << 20)
    print("directory: from_config round trip with numpy ints exact; a file renamed to another id refused; "
          "directory '' and 128 MiB chunks refused")


# -- inspect ---------------------------------------------------------------------------------------
def _inspect(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "capsule_ros.cli.inspect_cmd", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)


def test_inspect_command(tmp_path, kek):
    good, enc, bad = tmp_path / "good.capsule", tmp_path / "enc.capsule", tmp_path / "bad.capsule"
    blob = capsule_bytes(tmp_path)
    good.write_bytes(blob)
    enc.write_bytes(capsule_bytes(tmp_path, kek))
    key_file = tmp_path / "kek"
    key_file.write_bytes(kek)
    os.chmod(key_file, 0o600)
    damaged = bytearray(blob)
    damaged[-100] ^= 0x10                      # inside the last chunk
    bad.write_bytes(damaged)

    ok = _inspect(str(good))
    assert ok.returncode == 0, ok.stderr
    assert FP in ok.stdout and "e1.s7.abc123" in ok.stdout and "'kv'" in ok.stdout and "yes: 6 chunk" in ok.stdout
    ok_enc = _inspect(str(enc), "--key-file", str(key_file), "--json")
    report = json.loads(ok_enc.stdout)
    assert ok_enc.returncode == 0 and report["valid"] and report["header"]["encrypted"]
    broken = _inspect(str(bad))
    reason = broken.stderr.strip()
    assert broken.returncode == 2 and "Traceback" not in broken.stderr and len(reason.splitlines()) == 1
    assert "CorruptCapsule" in reason and "chunk 5" in reason
    print(f"inspect: valid -> exit {ok.returncode}, encrypted with --key-file -> exit {ok_enc.returncode}, "
          f"corrupted -> exit {broken.returncode}: {reason}")
