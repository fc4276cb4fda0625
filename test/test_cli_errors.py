"""Every ``capsule-ros`` subcommand on unusable paths, through the installed executable as a
user runs it: the documented exit status (docs/command-line.md), the last non-empty line
on stderr is the one-line reason naming the path and the cause, no Python traceback
anywhere in the output, and nothing half-written left behind (the scratch directory, and
a mounted file system's contents, are as they were).

What each situation simulates, and how (the tests run as root):

- ``missing``, ``file for a directory``, ``directory for a file``, ``symlink loop``
  (a -> b -> a): plain paths.
- ``no permission``: the command runs as root WITHOUT CAP_DAC_OVERRIDE and
  CAP_DAC_READ_SEARCH (``setpriv`` drops them from the bounding set), so file modes bind
  as for any user; the path is a directory of mode 0500 / 0, or a file of mode 0. (The
  user ``nobody`` cannot run this machine's Python: it lives under /root, mode 0700.)
- ``read-only``: a read-only bind mount of the directory, in a mount namespace of the
  command's own (``unshare --mount``): EROFS, as on a read-only medium.
- ``immutable``: ``chattr +i`` on the directory: EPERM for any change, root's too.
- ``busy``: an empty directory that is a mount point (a tmpfs mounted on it in the
  command's mount namespace): it cannot be removed or replaced (EBUSY).
- ``full disk``: a 256 KiB tmpfs filled to its last byte, in the command's mount
  namespace: ENOSPC on the first byte written.
- ``file size limit``: RLIMIT_FSIZE (``ulimit -f``): EFBIG on a write past it, the route to
  a failed write on a machine that allows no mounts.

A situation this machine does not allow (no mount namespaces, no ``chattr``) is skipped
with its reason; the file size limit still covers a failed write there. ``record`` asks a
running policy_node to write the bag, so its cases run against a node started in that
situation.
"""
from __future__ import annotations

import dataclasses
import os
import re
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import yaml
from harness import REPO, deep_merge
from runtime_fixtures import default_config, feed, observations

from capsule_ros.config import load_params_file
from capsule_ros.runtime.weights import save_weights
from capsule_ros.serving.factory import build_policy, build_session

SETPRIV = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
TMPFS_BYTES = 256 * 1024
FSIZE_BYTES = 16 * 1024
BAG = REPO / "test" / "fixtures" / "rollback_mcap"
EXPORTED = "runtime_fixtures:RunningSum"          # test/ is on the commands' PYTHONPATH
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "test"), os.environ.get("PYTHONPATH", "")])}
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s+File \".*\", line \d+", re.M)


def _allowed(argv: Sequence[str]) -> Optional[str]:
    """None when this machine runs ``argv`` successfully, else why not."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def _chattr_allowed(tmp: Path) -> Optional[str]:
    probe = tmp / "chattr-probe"
    probe.mkdir()
    try:
        return _allowed(["chattr", "+i", str(probe)])
    finally:
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
        probe.rmdir()


@dataclasses.dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    left_in_mount: Optional[List[str]]          # what a mounted file system held after the command

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


@dataclasses.dataclass
class Situation:
    """How the command runs so that a path is unusable (the module docstring says what
    each simulates): without the capabilities that bypass file modes, in a mount namespace
    of its own with these mounts, under a file size limit, with directories made immutable."""

    name: str
    unprivileged: bool = False                          # root without the capabilities that bypass modes
    mounts: Tuple[str, ...] = ()                        # shell lines run in the command's mount namespace
    watched: Optional[str] = None                       # the mount whose contents are listed afterwards
    fsize: Optional[int] = None                         # RLIMIT_FSIZE in bytes
    immutable: Tuple[Path, ...] = ()                    # chattr +i for the command's run

    def run(self, argv: Sequence[str], scratch: Path, timeout: float = 300) -> Outcome:
        command = list(argv)
        listing = scratch.parent / f"{scratch.name}.listing"
        if self.mounts:
            script = "\n".join(["set -e", *self.mounts, "set +e", '"$@"', "rc=$?",
                                *([f"find {self.watched} -mindepth 1 -printf '%P\\n' > {listing}"]
                                  if self.watched else []), "exit $rc"])
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command]
        if self.unprivileged:
            command = [*SETPRIV, *command]

        def limit() -> None:
            if self.fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (self.fsize, self.fsize))
        for path in self.immutable:
            subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=scratch, env=ENV,
                                  preexec_fn=limit if self.fsize is not None else None)
        finally:
            for path in self.immutable:
                subprocess.run(["chattr", "-i", str(path)], check=True)
        left = listing.read_text().split() if self.watched and listing.exists() else None
        return Outcome(done.returncode, done.stdout, done.stderr, left)


def tree(root: Path) -> Dict[str, Tuple[bool, int]]:
    """Every path under ``root`` (not following links): is it a directory, its size."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path.relative_to(root))] = (path.is_dir() and not path.is_symlink(), st.st_size)
    return out


@dataclasses.dataclass
class Case:
    """One row of the table: a subcommand on one unusable path."""

    command: str
    situation: str
    build: Callable[[Path, World], Run]        # (scratch directory, world) -> the run
    code: int
    cause: str                            # a regular expression the last line must match (case-insensitive)

    @property
    def id(self) -> str:
        return f"{self.command}-{self.situation}"


@dataclasses.dataclass
class World:
    """Files the cases start from: a capsule directory of real sessions of the default
    policy, the parameter file of a deployment with new weights, a capsule file, a bag."""

    src: Path
    params: Path
    capsule: Path
    weights: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    tmp = tmp_path_factory.mktemp("cli_world")
    config = default_config(tmp)
    policy = build_policy(config)
    old, new = tmp / "old.safetensors", tmp / "new.safetensors"
    save_weights(old, policy.state_dict())
    noise = torch.Generator().manual_seed(3)
    save_weights(new, {k: v + 1e-3 * torch.randn(v.shape, generator=noise) for k, v in policy.state_dict().items()})
    config = dataclasses.replace(config, policy=dataclasses.replace(config.policy, weights=str(old)),
                                 capsules=dataclasses.replace(config.capsules, directory=str(tmp / "src")))
    session = build_session(config)
    obs = observations(30, seed=5)
    feed(session, obs[:10])
    session.verbs.commit("a", persist=True)
    feed(session, obs[10:30])
    session.verbs.commit("b", persist=True)
    session.release()
    params = load_params_file(REPO / "config" / "policy.yaml")
    params = deep_merge(params, {"policy": {"weights": str(new)}, "runtime": {"device": "cpu"},
                                 "control": {"deadline_ms": 0.0}})
    params_path = tmp / "new.yaml"
    params_path.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    capsule = next((tmp / "src").glob("*.capsule"))
    assert capsule.stat().st_size > FSIZE_BYTES            # a capsule file runs into the file size limit
    return World(tmp / "src", params_path, capsule, new)


# -- the situations -----------------------------------------------------------------------------------

def loop(at: Path) -> Path:
    """``at`` -> ``at``.other -> ``at``: a symlink loop."""
    other = at.with_name(at.name + ".other")
    at.symlink_to(other.name)
    other.symlink_to(at.name)
    return at


def locked_dir(at: Path, mode: int = 0o000) -> Path:
    at.mkdir()
    at.chmod(mode)
    return at


def plain(name: str = "plain") -> Situation:
    return Situation(name)


def unprivileged() -> Situation:
    return Situation("no permission", unprivileged=True)


def read_only(directory: Path) -> Situation:
    directory.mkdir(exist_ok=True)
    return Situation("read-only", mounts=(f"mount --bind {directory} {directory}",
                                          f"mount -o remount,bind,ro {directory}"))


def mount_point(directory: Path) -> Situation:
    directory.mkdir(exist_ok=True)
    return Situation("busy", mounts=(f"mount -t tmpfs -o size=64k capsule-ros-busy {directory}",))


def full_disk(directory: Path) -> Situation:
    """A tmpfs on ``directory`` with every byte taken by ``filler``."""
    directory.mkdir(exist_ok=True)
    return Situation("full disk", mounts=(f"mount -t tmpfs -o size={TMPFS_BYTES} capsule-ros-full {directory}",
                                          f"cat /dev/zero > {directory}/filler 2>/dev/null || true"),
                     watched=str(directory))


def fsize_limit() -> Situation:
    return Situation("file size limit", fsize=FSIZE_BYTES)


def immutable(*paths: Path) -> Situation:
    return Situation("immutable", immutable=tuple(paths))


# -- the table --------------------------------------------------------------------------------------

ENOENT, ENOTDIR, EISDIR = r"no such file or directory", r"not a directory", r"is a directory"
EACCES, EROFS, EPERM = r"permission denied", r"read-only file system", r"operation not permitted|immutable"
EBUSY, ENOSPC, EFBIG, ELOOP = (r"device or resource busy|mount point", r"no space left on device",
                               r"file too large", r"too many levels of symbolic links|symlink loop")


@dataclasses.dataclass
class Run:
    """A case's command line, its situation, and the unusable path the reason must name."""

    argv: List[str]
    culprit: Path
    situation: Situation = dataclasses.field(default_factory=plain)


def _check(s: Path, w: World, *, directory: Optional[Path] = None, params: Optional[Path] = None,
           situation: Optional[Situation] = None) -> Run:
    return Run(["check", str(directory or w.src), "--params", str(params or w.params)],
               directory or params or w.src, situation or plain())


def _regenerate(s: Path, w: World, *, src: Optional[Path] = None, params: Optional[Path] = None,
                out: Optional[Path] = None, situation: Optional[Situation] = None) -> Run:
    return Run(["regenerate", str(src or w.src), "--params", str(params or w.params), "--out", str(out or s / "dst")],
               src or params or out or s / "dst", situation or plain())


def _bag(s: Path) -> Path:
    shutil.copytree(BAG, s / "bag")
    return s / "bag"


def _replay(s: Path, w: World, *, bag: Optional[Path] = None, option: Tuple[str, Path] = None,
            situation: Optional[Situation] = None) -> Run:
    extra = [option[0], str(option[1])] if option else []
    return Run(["replay", str(bag or _bag(s)), *extra], option[1] if option else bag, situation or plain())


def _inspect(s: Path, w: World, *, path: Optional[Path] = None, key: Optional[Path] = None,
             situation: Optional[Situation] = None) -> Run:
    return Run(["inspect", str(path or w.capsule), *(["--key-file", str(key)] if key else [])], path or key,
               situation or plain())


def _export(out: Path, situation: Optional[Situation] = None) -> Run:
    return Run(["export", "--module", EXPORTED, "--out", str(out)], out, situation or plain())


def _demo(out: Path, weights: Optional[Path] = None, situation: Optional[Situation] = None) -> Run:
    return Run(["demo", "--episodes", "1", "--headless", "--out", str(out),
                *(["--weights", str(weights)] if weights else [])], weights or out, situation or plain())


def _bench(python: Path) -> Run:
    return Run(["bench", "chunking", "--quick", "--cases", "act10", "--lerobot-python", str(python)], python)


def _file(path: Path, text: str = "x") -> Path:
    path.write_text(text)
    return path


def _locked_file(path: Path) -> Path:
    path.write_text("x")
    return _locked(path)


def _locked(path: Path) -> Path:
    path.chmod(0)
    return path


def _metadata_dir(bag: Path) -> Path:
    """A bag whose metadata.yaml is a directory."""
    (bag / "metadata.yaml").unlink()
    (bag / "metadata.yaml").mkdir()
    return bag / "metadata.yaml"


CASES = [
    # check DIR --params FILE: reads headers, writes nothing (refused: 3)
    Case("check", "missing", lambda s, w: _check(s, w, directory=s / "nowhere"), 3, ENOENT),
    Case("check", "file-for-dir", lambda s, w: _check(s, w, directory=_file(s / "afile")), 3, ENOTDIR),
    Case("check", "dir-for-file", lambda s, w: _check(s, w, params=locked_dir(s / "p.yaml", 0o755)), 3, EISDIR),
    Case("check", "no-permission", lambda s, w: _check(s, w, directory=locked_dir(s / "locked"),
                                                       situation=unprivileged()), 3, EACCES),
    Case("check", "params-no-permission", lambda s, w: _check(s, w, params=_locked_file(s / "p.yaml"),
                                                              situation=unprivileged()), 3, EACCES),
    Case("check", "symlink-loop", lambda s, w: _check(s, w, directory=loop(s / "loop")), 3, ELOOP),
    Case("check", "params-symlink-loop", lambda s, w: _check(s, w, params=loop(s / "p.yaml")), 3, ELOOP),
    # regenerate SRC --params FILE --out DST: DST written completely or not at all (refused: 3)
    Case("regenerate", "missing", lambda s, w: _regenerate(s, w, src=s / "nowhere"), 3, ENOENT),
    Case("regenerate", "file-for-dir", lambda s, w: _regenerate(s, w, src=_file(s / "afile")), 3, ENOTDIR),
    Case("regenerate", "dir-for-file", lambda s, w: _regenerate(s, w, params=locked_dir(s / "p.yaml", 0o755)), 3,
         EISDIR),
    Case("regenerate", "no-permission", lambda s, w: _regenerate(s, w, src=locked_dir(s / "locked"),
                                                                 situation=unprivileged()), 3, EACCES),
    Case("regenerate", "symlink-loop", lambda s, w: _regenerate(s, w, src=loop(s / "loop")), 3, ELOOP),
    Case("regenerate", "out-parent-missing", lambda s, w: _regenerate(s, w, out=s / "nowhere" / "dst"), 3, ENOENT),
    Case("regenerate", "out-parent-a-file", lambda s, w: _regenerate(s, w, out=_file(s / "afile") / "dst"), 3,
         ENOTDIR),
    Case("regenerate", "out-a-file", lambda s, w: _regenerate(s, w, out=_file(s / "dst")), 3,
         r"not a directory|not an empty directory"),
    Case("regenerate", "out-no-permission", lambda s, w: _regenerate(
        s, w, out=locked_dir(s / "locked", 0o500) / "dst", situation=unprivileged()), 3, EACCES),
    Case("regenerate", "out-read-only", lambda s, w: _regenerate(
        s, w, out=s / "ro" / "dst", situation=read_only(s / "ro")), 3, EROFS),
    Case("regenerate", "out-immutable-empty-dir", lambda s, w: _regenerate(
        s, w, out=locked_dir(s / "dst", 0o755), situation=immutable(s / "dst")), 3, EPERM),
    Case("regenerate", "out-immutable-parent", lambda s, w: _regenerate(
        s, w, out=locked_dir(s / "frozen", 0o755) / "dst", situation=immutable(s / "frozen")), 3, EPERM),
    Case("regenerate", "out-busy-mount-point", lambda s, w: _regenerate(
        s, w, out=s / "dst", situation=mount_point(s / "dst")), 3, EBUSY),
    Case("regenerate", "out-full-disk", lambda s, w: _regenerate(
        s, w, out=s / "full" / "dst", situation=full_disk(s / "full")), 3, ENOSPC),
    Case("regenerate", "out-file-size-limit", lambda s, w: _regenerate(s, w, out=s / "dst", situation=fsize_limit()),
         3, EFBIG),
    Case("regenerate", "out-symlink-loop", lambda s, w: _regenerate(s, w, out=loop(s / "dst")), 3, ELOOP),
    # replay BAG: reads the bag, writes nothing (refused: 2)
    Case("replay", "missing", lambda s, w: _replay(s, w, bag=s / "nowhere"), 2, ENOENT),
    Case("replay", "file-for-dir", lambda s, w: _replay(s, w, bag=_file(s / "afile")), 2, ENOTDIR),
    Case("replay", "dir-for-file", lambda s, w: dataclasses.replace(_replay(s, w, bag=_bag(s)),
                                                                   culprit=_metadata_dir(s / "bag")), 2, EISDIR),
    Case("replay", "no-permission", lambda s, w: _replay(s, w, bag=_locked(_bag(s)), situation=unprivileged()), 2,
         EACCES),
    Case("replay", "symlink-loop", lambda s, w: _replay(s, w, bag=loop(s / "loop")), 2, ELOOP),
    Case("replay", "params-dir-for-file", lambda s, w: _replay(
        s, w, option=("--params-file", locked_dir(s / "p.yaml", 0o755))), 2, EISDIR),
    Case("replay", "capsule-dir-a-file", lambda s, w: _replay(s, w, option=("--capsule-dir", _file(s / "caps"))), 2,
         ENOTDIR),
    # inspect FILE: reads one capsule file (refused: 2)
    Case("inspect", "missing", lambda s, w: _inspect(s, w, path=s / "nowhere.capsule"), 2, ENOENT),
    Case("inspect", "dir-for-file", lambda s, w: _inspect(s, w, path=locked_dir(s / "d.capsule", 0o755)), 2, EISDIR),
    Case("inspect", "no-permission", lambda s, w: _inspect(s, w, path=_locked_file(s / "x.capsule"),
                                                           situation=unprivileged()), 2, EACCES),
    Case("inspect", "symlink-loop", lambda s, w: _inspect(s, w, path=loop(s / "x.capsule")), 2, ELOOP),
    Case("inspect", "key-dir-for-file", lambda s, w: _inspect(s, w, key=locked_dir(s / "kek", 0o700)), 2, EISDIR),
    Case("inspect", "key-missing", lambda s, w: _inspect(s, w, key=s / "nokek"), 2, ENOENT),
    # export --out FILE.pt2: written completely or not at all (refused: 2)
    Case("export", "out-parent-missing", lambda s, w: _export(s / "nowhere" / "p.pt2"), 2, ENOENT),
    Case("export", "out-parent-a-file", lambda s, w: _export(_file(s / "afile") / "p.pt2"), 2, ENOTDIR),
    Case("export", "dir-for-file", lambda s, w: _export(locked_dir(s / "p.pt2", 0o755)), 2, EISDIR),
    Case("export", "no-permission", lambda s, w: _export(locked_dir(s / "locked", 0o500) / "p.pt2",
                                                         situation=unprivileged()), 2, EACCES),
    Case("export", "read-only", lambda s, w: _export(s / "ro" / "p.pt2", situation=read_only(s / "ro")), 2, EROFS),
    Case("export", "immutable", lambda s, w: _export(locked_dir(s / "frozen", 0o755) / "p.pt2",
                                                     situation=immutable(s / "frozen")), 2, EPERM),
    Case("export", "full-disk", lambda s, w: _export(s / "full" / "p.pt2", situation=full_disk(s / "full")), 2,
         ENOSPC),
    Case("export", "file-size-limit", lambda s, w: _export(s / "p.pt2", situation=fsize_limit()), 2, EFBIG),
    Case("export", "symlink-loop", lambda s, w: _export(loop(s / "p.pt2")), 2, ELOOP),
    # demo --out DIR [--weights FILE]: refused before policy_node starts (2)
    Case("demo", "out-a-file", lambda s, w: _demo(_file(s / "run")), 2, ENOTDIR + "|file exists"),
    Case("demo", "out-parent-a-file", lambda s, w: _demo(_file(s / "afile") / "run"), 2, ENOTDIR),
    Case("demo", "no-permission", lambda s, w: _demo(locked_dir(s / "locked", 0o500) / "run",
                                                     situation=unprivileged()), 2, EACCES),
    Case("demo", "read-only", lambda s, w: _demo(s / "ro" / "run", situation=read_only(s / "ro")), 2, EROFS),
    Case("demo", "immutable", lambda s, w: _demo(locked_dir(s / "run", 0o755), situation=immutable(s / "run")), 2,
         EPERM),
    Case("demo", "full-disk", lambda s, w: _demo(s / "full" / "run", situation=full_disk(s / "full")), 2, ENOSPC),
    Case("demo", "symlink-loop", lambda s, w: _demo(loop(s / "run")), 2, ELOOP),
    Case("demo", "weights-missing", lambda s, w: _demo(s / "run", weights=s / "none.safetensors"), 2, ENOENT),
    Case("demo", "weights-dir-for-file", lambda s, w: _demo(s / "run", weights=locked_dir(s / "w.st", 0o755)), 2,
         EISDIR),
    # bench chunking --lerobot-python FILE: refused before any benchmark runs (2)
    Case("bench", "missing", lambda s, w: _bench(s / "nowhere" / "python"), 2, ENOENT),
    Case("bench", "dir-for-file", lambda s, w: _bench(locked_dir(s / "python", 0o755)), 2, EISDIR),
    Case("bench", "symlink-loop", lambda s, w: _bench(loop(s / "python")), 2, ELOOP),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_an_unusable_path_ends_in_one_line_and_the_documented_exit_status(case, world, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = case.build(scratch, world)
    situation = run.situation
    if situation.mounts and (why := _allowed(["unshare", "--mount", "--propagation", "private", "true"])):
        pytest.skip(f"{situation.name}: this machine allows no mount namespace ({why}); the file size limit "
                    "covers a failed write")
    if situation.immutable and (why := _chattr_allowed(tmp_path)):
        pytest.skip(f"immutable: chattr +i is not allowed here ({why})")
    before, src_before = tree(scratch), tree(world.src)
    outcome = situation.run(["capsule-ros", *run.argv], scratch)
    shown = f"exit {outcome.code}\nstderr:\n{outcome.stderr[-3000:]}\nstdout:\n{outcome.stdout[-1000:]}"
    assert outcome.code == case.code, shown
    assert not TRACEBACK.search(outcome.stderr) and not TRACEBACK.search(outcome.stdout), shown
    last = outcome.last_line
    assert last.startswith(f"capsule-ros {case.command}: "), shown
    assert str(run.culprit) in last, f"{run.culprit} is not named in the last line: {last}"
    assert re.search(case.cause, last, re.I), f"cause /{case.cause}/ not in the last line: {last}"
    assert tree(scratch) == before, f"the scratch directory changed: {tree(scratch)} != {before}"
    assert tree(world.src) == src_before, "SRC changed"
    if situation.watched:
        assert outcome.left_in_mount == ["filler"], f"left on the full disk: {outcome.left_in_mount}"


# -- record: the node writes the bag -----------------------------------------------------------------

RECORD_NS = "/cli_errors"


@dataclasses.dataclass
class RecordNode:
    proc: object                    # harness.ManagedProcess
    root: Path                      # where the cases' paths are
    namespaced: bool                # the node has its own mount namespace (read-only and full disk cases)

    def left_in(self, directory: Path) -> List[str]:
        """What ``directory`` holds as the node sees it (inside its mount namespace)."""
        done = subprocess.run(["nsenter", "-t", str(self.proc.proc.pid), "-m", "find", str(directory), "-mindepth",
                               "1", "-printf", "%P\\n"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()


@pytest.fixture(scope="module")
def record_node(tmp_path_factory):
    """One policy_node that records where the cases say: root without CAP_DAC_OVERRIDE (modes
    bind), in a mount namespace of its own with ``ro`` a read-only bind mount and ``full`` a
    full tmpfs (when this machine allows mount namespaces)."""
    root = tmp_path_factory.mktemp("record_cases")
    (root / "ro").mkdir()
    (root / "full").mkdir()
    namespaced = _allowed(["unshare", "--mount", "--propagation", "private", "true"]) is None
    params = deep_merge(load_params_file(REPO / "config" / "policy.yaml"),
                        {"runtime": {"device": "cpu"}, "capsules": {"directory": str(root / "capsules")}})
    overlay = root / "params.yaml"
    overlay.write_text(yaml.safe_dump({"/**": {"ros__parameters": params}}))
    from capsule_ros.ros.processes import ManagedProcess, installed_executable
    node = [installed_executable("policy_node"), "--ros-args", "--params-file", str(overlay),
            "-r", f"__ns:={RECORD_NS}"]
    if namespaced:
        ro, full = read_only(root / "ro"), full_disk(root / "full")
        script = "\n".join(["set -e", *ro.mounts, *full.mounts, 'exec "$@"'])
        node = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *node]
    proc = ManagedProcess([*SETPRIV, *node], root / "node.log")
    yield RecordNode(proc, root, namespaced)
    code = proc.stop()
    assert code == 0, proc.log()[-3000:]


RECORD_CASES = {
    # name: (how the --out path is made, its situation, the cause); None: a bag is written
    "writable": (lambda r: r / "ok" / "bag", None, None),
    "parent-a-file": (lambda r: _file(r / "afile") / "bag", "plain", ENOTDIR),
    "exists-already": (lambda r: locked_dir(r / "there", 0o755), "plain", r"exists already"),
    "no-permission": (lambda r: locked_dir(r / "locked", 0o500) / "bag", "plain", EACCES),
    "read-only": (lambda r: r / "ro" / "bag", "namespace", EROFS),
    "immutable": (lambda r: locked_dir(r / "frozen", 0o755) / "bag", "immutable", EPERM),
    "full-disk": (lambda r: r / "full" / "bag", "namespace", ENOSPC),
    "symlink-loop": (lambda r: loop(r / "loop") / "bag", "plain", ELOOP),
}


@pytest.mark.ros
@pytest.mark.parametrize("name", list(RECORD_CASES))
def test_record_where_the_node_cannot_write_ends_in_one_line_and_leaves_no_bag(name, record_node, tmp_path):
    """``capsule-ros record --out`` a path the node cannot use: exit 2, the node's reason
    (path and cause) as the last line, and nothing of the bag left where the node writes
    (also on the full disk, seen from inside the node's mount namespace). ``writable``:
    the same node records a bag that replays, so the refusals are the paths'."""
    make, situation, cause = RECORD_CASES[name]
    if situation == "namespace" and not record_node.namespaced:
        pytest.skip(f"{name}: this machine allows no mount namespace; the file size limit covers a failed write")
    if situation == "immutable" and (why := _chattr_allowed(tmp_path)):
        pytest.skip(f"immutable: chattr +i is not allowed here ({why})")
    case_root = record_node.root / name
    case_root.mkdir()
    out = make(case_root if situation != "namespace" else record_node.root)
    watched = out.parent
    frozen = immutable(out.parent) if situation == "immutable" else plain()
    before = tree(case_root)
    done = frozen.run(["capsule-ros", "record", "--node", f"{RECORD_NS}/capsule_policy", "--out", str(out),
                       "--duration", "0.5", "--wait", "60"], case_root, timeout=120)
    shown = f"exit {done.code}\nstderr:\n{done.stderr[-3000:]}\nnode log:\n{record_node.proc.log()[-2000:]}"
    assert not TRACEBACK.search(done.stderr) and not TRACEBACK.search(done.stdout), shown
    if cause is None:
        assert done.code == 0 and done.stdout.strip() == str(out), shown
        assert (out / "metadata.yaml").is_file()
        return
    assert done.code == 2, shown
    last = done.last_line
    assert last.startswith("capsule-ros record: ") and str(out) in last, shown
    assert re.search(cause, last, re.I), f"cause /{cause}/ not in the last line: {last}"
    if situation == "namespace":
        assert record_node.left_in(watched) == (["filler"] if name == "full-disk" else []), shown
    else:
        assert tree(case_root) == before, f"left behind: {tree(case_root)} != {before}"


# -- the documented statuses ------------------------------------------------------------------------

def test_the_documented_exit_statuses_are_the_ones_help_prints(capsys):
    """docs/command-line.md's table is ``COMMANDS``, and each command's ``--help`` lists them."""
    from capsule_ros.cli.command import COMMANDS
    from capsule_ros.cli.main import main
    text = (REPO / "docs" / "command-line.md").read_text()
    table = text.split("## Exit statuses", 1)[1].split("\n\n", 2)[1]
    documented: Dict[str, List[Tuple[int, str]]] = {}
    command = ""
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        command = cells[0].strip("`") or command
        documented.setdefault(command, []).append((int(cells[1]), cells[2]))
    assert documented == {name: list(c.exits) for name, c in COMMANDS.items()}
    for name, command_ in COMMANDS.items():
        assert main([name, *(["snapshot"] if name == "bench" else []), "--help"]) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert all(f"{code} {' '.join(meaning.split())}" in shown for code, meaning in command_.exits), shown


def test_a_usage_error_exits_with_the_commands_refusal_status(capsys):
    """argparse's own status is 2, which ``check`` and ``regenerate`` use for lost capsules."""
    from capsule_ros.cli.command import COMMANDS
    from capsule_ros.cli.main import main
    for name in ("check", "regenerate", "replay", "export"):
        assert main([name, "--no-such-option"]) == COMMANDS[name].refused
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"capsule-ros {name}: ")


@pytest.mark.ros
def test_demo_ends_in_policy_nodes_own_line_when_it_cannot_start(tmp_path):
    """A policy_node that refuses to start (here ``--device`` names no device): the demo
    ends with the node's one-line reason and exit 2, and removes the run directory it made."""
    out = tmp_path / "runs" / "demo"
    done = plain().run(["capsule-ros", "demo", "--episodes", "1", "--headless", "--device", "nowhere",
                        "--out", str(out)], tmp_path, timeout=180)
    shown = f"exit {done.code}\nstderr:\n{done.stderr[-3000:]}"
    assert done.code == 2 and not TRACEBACK.search(done.stderr + done.stdout), shown
    assert re.fullmatch(r"capsule-ros demo: policy_node could not start: policy_node: .*runtime\.device.*'nowhere'.*"
                        r"\(exit 2\)", done.last_line), shown
    assert not (tmp_path / "runs").exists()
