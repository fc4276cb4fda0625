"""Policies from outside the package, without ROS: the example package's ``gru_chunk`` kind
and ``policy.kind: exported`` (a torch.export program written by ``capsule-ros export``).

- the example kind is registered by entry point and served from the arena: its head (the
  network's chunk part) runs once every ``chunk_horizon`` steps, one row executed per step;
- the exported example serves the eager module's actions bit for bit, the same as the
  ``gru_chunk`` kind, and capsules roll it back bit-identically;
- ports that do not fit a program are refused from its metadata, naming the mismatch;
- a program file that torch would unpickle arbitrary objects from is refused without
  running them; a file whose program and metadata disagree is refused, and so is metadata
  that breaks the export rules (batch 1, ``seed`` for ``rng`` only, 64 MiB of initial values);
- modules that break the export interface are refused by ``capsule-ros export`` with one
  line that says what to change; initial values and the seeded RNG rule are kept;
- on a GPU the graph-captured exported step equals the exported module run eagerly.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import pickle
import zipfile
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from runtime_fixtures import GRU_FACTORY, eager_gru, feed, gru_config, observations
from torch import nn

from capsule_ros.chunking.mark import ChunkingMark
from capsule_ros.chunking.mode import mode_for
from capsule_ros.chunking.workers import InlineRefill, ThreadRefill
from capsule_ros.errors import ConfigError
from capsule_ros.policies.export import InterfaceError, export_module
from capsule_ros.policies.exported import ExportedConfig, ExportedPolicy, ProgramError
from capsule_ros.policies.registry import kind_names, policy_kind
from capsule_ros.runtime.arena import BufferKind, BufferSpec
from capsule_ros.runtime.builder import build_policy_runtime
from capsule_ros.runtime.engine import PolicyRuntime, RuntimeConfig
from capsule_ros.runtime.rng import counter_normal
from capsule_ros.serving.factory import build_runtime, build_session

torch.set_num_threads(1)
HORIZON = 8       # policy.gru_chunk.chunk_horizon of examples/gru_policy/config/gru_chunk.yaml


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """The example's module (the settings of its parameter file) exported to a .pt2."""
    from capsule_gru_policy.export import module
    path = tmp_path_factory.mktemp("program") / "gru.pt2"
    report = export_module(module(**GRU_FACTORY), path, source={"module": "capsule_gru_policy.export:module"})
    assert report.mismatch is None, report.summary()
    return path


def step_all(runtime: PolicyRuntime, obs: np.ndarray) -> list:
    out = []
    for row in obs:
        runtime.staging["joints"][:] = row[:4]
        runtime.staging["goal"][:] = row[4:]
        runtime.load_inputs()
        runtime.step()
        o = runtime.read_outputs()
        out.append((o.action, o.chunk))
    return out


def as_bytes(pairs) -> List[bytes]:
    return [a.tobytes() + c.tobytes() for a, c in pairs]


# -- the example package's kind ------------------------------------------------------------------

def test_the_example_kind_is_registered_by_entry_point_with_its_own_settings():
    from capsule_gru_policy.model import GruChunkConfig
    assert {"hybrid", "exported", "gru_chunk"} <= set(kind_names())
    kind = policy_kind("gru_chunk")
    assert kind.settings is GruChunkConfig and kind.name == "gru_chunk"
    assert all(f.metadata["read_only"] for f in GruChunkConfig.settings())
    with pytest.raises(ConfigError, match=r"policy.gru_chunk.hidden = 0: must be >= 1"):
        GruChunkConfig.from_mapping({"hidden": 0}, section="policy.gru_chunk")


def test_gru_chunk_executes_one_row_per_step_of_a_chunk_planned_every_horizon_steps(tmp_path):
    runtime = build_runtime(gru_config(tmp_path))
    refills = runtime.mode.counters.refills
    out = step_all(runtime, observations(3 * HORIZON, 1))
    chunks = [out[t][1] for t in (0, HORIZON, 2 * HORIZON)]          # predicted at steps 1, 9, 17
    assert chunks[0].tobytes() != chunks[1].tobytes() != chunks[2].tobytes()
    for t, (action, chunk) in enumerate(out):
        predicted, index = chunks[t // HORIZON], t % HORIZON
        upcoming = predicted[np.minimum(index + np.arange(HORIZON), HORIZON - 1)]   # the rest, the last one held
        assert chunk.tobytes() == upcoming.tobytes(), t
        assert action.tobytes() == predicted[index].tobytes(), t
    assert int(runtime.arena["chunk.cursor"][0]) == HORIZON          # three whole chunks executed
    assert runtime.mode.counters.refills - refills == 3          # the head ran three times in 24 steps


@pytest.mark.parametrize("exported", [False, True], ids=["gru_chunk", "exported"])
def test_exported_programs_and_the_example_kind_plan_only_when_a_chunk_is_due(tmp_path, program, exported):
    runtime = build_runtime(gru_config(tmp_path, program if exported else None))
    schedule = runtime.mode.schedule
    assert schedule is not None and schedule.describe() == f"sync, {HORIZON} of {HORIZON} actions per chunk"
    refills, consumes = runtime.mode.counters.refills, runtime.mode.counters.consumes
    step_all(runtime, observations(3 * HORIZON, 1))
    assert runtime.mode.counters.refills - refills == 3
    assert runtime.mode.counters.consumes - consumes == 3 * (HORIZON - 1)


@pytest.mark.parametrize("exported", [False, True], ids=["gru_chunk", "exported"])
def test_async_chunking_of_the_example_equals_its_inline_plan_and_survives_a_capsule_in_flight(tmp_path, program,
                                                                                                exported):
    """Async (d = 2) with the refill worker's thread gives the bits of the same schedule
    planned inline; a state taken while a request is out (cursor past the horizon, pending)
    restored into another runtime re-issues it and continues bit-identically."""
    config = gru_config(tmp_path, program if exported else None)
    config = dataclasses.replace(config, control=dataclasses.replace(config.control, chunking="async",
                                                                     inference_delay_steps="2"))
    threaded = build_runtime(config)
    inline = build_runtime(config, worker="inline")
    assert isinstance(threaded.mode.worker, ThreadRefill) and isinstance(inline.mode.worker, InlineRefill)
    schedule = threaded.mode.schedule
    assert (schedule.delay, schedule.execution_horizon, schedule.end) == (2, HORIZON - 2, HORIZON)
    obs = observations(3 * HORIZON + 3, 5)
    in_flight = schedule.execution_horizon + 1    # the first chunk's request went out at row e and is not adopted yet
    head = step_all(threaded, obs[:in_flight])
    mark, state = threaded.mark(), threaded.arena.storage.clone()
    carried = ChunkingMark.parse(mark)
    assert carried.pending and schedule.execution_horizon < carried.cursor < schedule.end
    tail = step_all(threaded, obs[in_flight:])
    assert as_bytes(head + tail) == as_bytes(step_all(inline, obs))
    restored = build_runtime(config)
    restored.load_state(state)
    assert restored.mark() == mark
    assert as_bytes(step_all(restored, obs[in_flight:])) == as_bytes(tail)


# -- exported programs, served in-process --------------------------------------------------------

def test_exported_program_serves_the_eager_modules_actions_bit_for_bit_on_cpu(tmp_path, program):
    obs = observations(5 * HORIZON + 3, 2)
    exported = build_runtime(gru_config(tmp_path / "e", program))
    assert isinstance(exported.policy, ExportedPolicy)
    served = step_all(exported, obs)
    assert as_bytes(served) == as_bytes(eager_gru(obs))
    assert as_bytes(served) == as_bytes(step_all(build_runtime(gru_config(tmp_path / "g")), obs))  # the kind, too
    arch = exported.policy.architecture()
    assert arch["policy"] == "exported" and len(arch["program_sha256"]) == 64


def test_capsules_roll_an_exported_program_back_bit_identically(tmp_path, program):
    session = build_session(gru_config(tmp_path, program))
    feed(session, observations(5, 3))
    capsule = session.verbs.commit(label="k")
    obs = observations(2 * HORIZON + 5, 4)
    first = [r.values.tobytes() + r.chunk.tobytes() for r in feed(session, obs)]
    session.verbs.reenter(capsule.id)
    again = [r.values.tobytes() + r.chunk.tobytes() for r in feed(session, obs)]
    assert again == first and len(set(first)) > HORIZON


def test_the_fingerprint_covers_the_program_file(tmp_path, program):
    from capsule_gru_policy.export import module
    other = tmp_path / "other.pt2"
    export_module(module(**{**GRU_FACTORY, "seed": 1}), other)
    a = build_runtime(gru_config(tmp_path / "a", program)).fingerprint
    assert a == build_runtime(gru_config(tmp_path / "b", program)).fingerprint
    assert a != build_runtime(gru_config(tmp_path / "c", other)).fingerprint


# -- what is refused, and how --------------------------------------------------------------------

@pytest.mark.parametrize("ports, expect", [
    ({"goal": None, "target": {"topic": "arm/target", "type": "geometry_msgs/msg/PointStamped",
                               "fields": ["point.x", "point.y"], "shape": [2]}},
     r"no port for its input 'goal' float32\[2\] \(add it to ports.names\); port 'target' is not one of its inputs"),
    ({"joints": {"shape": [6], "fields": ["position", "velocity", "effort"]}},
     r"ports.joints is float32\[6\], its input 'joints' is float32\[4\] \(set ports.joints.shape / dtype"),
    ({"goal": {"dtype": "float64"}}, r"ports.goal is float64\[2\], its input 'goal' is float32\[2\]"),
])
def test_ports_that_do_not_fit_the_program_are_refused_from_its_metadata(tmp_path, program, ports, expect):
    from runtime_fixtures import gru_params

    from capsule_ros.serving.config import ServingConfig
    # a program whose graph is gone: only the metadata is read before the ports are refused
    hollow = rewrite(program, tmp_path / "hollow.pt2", drop=("models/model.json",))
    params = gru_params(tmp_path, hollow)
    for name, values in ports.items():
        if values is None:
            params["ports"]["names"].remove(name)
            del params["ports"][name]
        else:
            params["ports"].setdefault(name, {}).update(values)
            if name not in params["ports"]["names"]:
                params["ports"]["names"].append(name)
    with pytest.raises(ProgramError, match=expect):
        build_runtime(ServingConfig.from_params(params))


def rewrite(src: Path, dst: Path, drop=(), replace: Dict[str, bytes] = None) -> Path:
    """A copy of a .pt2 archive without the members ``drop`` and with ``replace`` (member path
    under the archive's root -> new bytes)."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            member = info.filename.split("/", 1)[1]
            if member in drop:
                continue
            zout.writestr(info.filename, replace.get(member, zin.read(info.filename)))
    return dst


class _Touch:
    """Unpickling this creates a file: proof that a full unpickler ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_program_file_that_would_unpickle_code_is_refused_without_running_it(tmp_path, program):
    sentinel = tmp_path / "ran"
    with zipfile.ZipFile(program) as z:
        config_name = next(n for n in z.namelist() if n.endswith("data/weights/model_weights_config.json"))
        weights_config = json.loads(z.read(config_name))
    first = next(iter(weights_config["config"]))
    weights_config["config"][first]["use_pickle"] = True
    cases = {
        "sample inputs": ({"data/sample_inputs/model.pt": pickle.dumps(_Touch(sentinel))},
                          "sample inputs are not plain tensors"),
        "pickled weight": ({"data/weights/model_weights_config.json": json.dumps(weights_config).encode()},
                           f"weight {first!r} is stored as a pickled object"),
        "legacy weights": ({"data/weights/model.pt": pickle.dumps(_Touch(sentinel))},
                           r"holds \['data/weights/model.pt'\], which torch.export.load would unpickle"),
    }
    for name, (replace, expect) in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.pt2"
        if name == "legacy weights":
            rewrite(program, bad)
            with zipfile.ZipFile(bad, "a") as z:
                z.writestr(f"{z.namelist()[0].split('/')[0]}/data/weights/model.pt", replace["data/weights/model.pt"])
        else:
            rewrite(program, bad, replace=replace)
        with pytest.raises(ProgramError, match=expect):
            ExportedPolicy.from_file(bad)
        assert not sentinel.exists(), f"{name}: a pickled object was run"


def test_a_program_whose_metadata_does_not_describe_it_is_refused(tmp_path, program):
    with zipfile.ZipFile(program) as z:
        name = next(n for n in z.namelist() if n.endswith("extra/capsule_ros.json"))
        meta = json.loads(z.read(name))
    meta["state"][0]["shape"] = [1, 32]                         # the program's hidden state is [1, 64]
    bad = rewrite(program, tmp_path / "lying.pt2", replace={"extra/capsule_ros.json": json.dumps(meta).encode()})
    with pytest.raises(ProgramError, match=r"mismatched: gru.h is float32\[1, 1, 64\] in the program, "
                                           r"float32\[1, 1, 32\] in the metadata"):
        ExportedPolicy.from_file(bad)
    with pytest.raises(ProgramError, match="not a .pt2 archive"):
        ExportedPolicy.from_file(Path(__file__))
    with pytest.raises(ConfigError, match=r"policy.exported.program: must name a .pt2 file"):
        ExportedConfig.from_mapping({}, section="policy.exported")


def test_metadata_that_breaks_the_export_rules_is_refused_when_the_program_is_loaded(tmp_path, program):
    with zipfile.ZipFile(program) as z:
        original = json.loads(z.read(next(n for n in z.namelist() if n.endswith("extra/capsule_ros.json"))))
    assert [e["name"] for e in original["state"]] == ["gru.h", "rng"]
    assert original["version"] == 2 and original["cadence"] == {"length": HORIZON, "horizon": HORIZON,
                                                                 "reads": ["gru.h"], "inputs_every_step": True}
    half = 2**25 + 4                                   # two buffers of just over 32 MiB: 64 MiB + 8 in all
    big = [{"name": f"big{i}", "shape": [half // 4], "dtype": "float32", "kind": "meta", "init": "values",
            "values": base64.b64encode(bytes(half)).decode()} for i in (1, 2)]
    cases = {
        "batch": ({"batch": 2}, r"batch 2, expected 'capsule_ros.exported' version 1 or 2, batch 1"),
        "cadence in version 1": ({"version": 1}, r"cadence .* \(version 2 metadata"),
        "rng not seeded": ({"state": [*original["state"][:1], {**original["state"][1], "init": "zeros"}]},
                           r"state 'rng': init 'zeros' \(one of .*'seed' for 'rng' only, and always\)"),
        "seeded buffer": ({"state": [{**original["state"][0], "init": "seed"}, *original["state"][1:]]},
                          r"state 'gru.h': init 'seed'"),
        "initial values": ({"state": [*original["state"], *big]},
                           rf"state 'big2': {half} bytes of initial values for {half} bytes \({2 * half} stored "
                           rf"in all, at most {2**26}\)"),
    }
    for name, (change, expect) in cases.items():
        bad = rewrite(program, tmp_path / f"{name.replace(' ', '_')}.pt2",
                      replace={"extra/capsule_ros.json": json.dumps({**original, **change}).encode()})
        with pytest.raises(ProgramError, match=rf"its capsule_ros metadata is not valid .*{expect}"):
            ExportedPolicy.from_file(bad)
        bad.unlink()
    unknown = {"cadence": {**original["cadence"], "reads": ["nope"]}}
    bad = rewrite(program, tmp_path / "reads.pt2", replace={"extra/capsule_ros.json": json.dumps({**original,
                                                                                                   **unknown}).encode()})
    with pytest.raises(ProgramError, match=r"reads.pt2: cadence reads \['nope'\], which are neither inputs nor state"):
        ExportedPolicy.from_file(bad)


# -- the export interface --------------------------------------------------------------------------

class Accumulator(nn.Module):
    """A small module that keeps the export interface: a running sum of its input, and a
    bias state that starts at one (stored initial values) and noise from the seeded RNG."""

    inputs = [BufferSpec("x", (3,), torch.float32, BufferKind.INPUT)]
    state = [BufferSpec("total", (3,), torch.float32, BufferKind.RECURRENT),
             BufferSpec("bias", (2,), torch.float32, BufferKind.META),
             BufferSpec("rng", (2,), torch.int64, BufferKind.META)]
    action_dim, chunk_horizon = 2, 1

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 2)
        self.register_buffer("advance", torch.tensor([0, 1]), persistent=False)

    def initial_state(self):
        return {"total": torch.zeros(3), "bias": torch.ones(2), "rng": torch.zeros(2, dtype=torch.int64)}

    def forward(self, x, total, bias, rng):
        total = total + x
        action = self.head(total) + bias + counter_normal(rng[0], (2,))
        return action, action[:, None], total, bias * 0.5, rng + self.advance


class NoInterface(nn.Linear):
    def __init__(self):
        super().__init__(3, 2)


class WrongChunk(Accumulator):
    def forward(self, x, total, bias, rng):
        action, _, *state = super().forward(x, total, bias, rng)
        return (action, action, *state)


class WritesItsState(Accumulator):
    def forward(self, x, total, bias, rng):
        total.add_(x)
        return super().forward(x, torch.zeros_like(total), bias, rng)


class PythonCounter(Accumulator):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, total, bias, rng):
        self.calls += 1
        return super().forward(x + self.calls, total, bias, rng)


class BufferCounter(Accumulator):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x, total, bias, rng):
        self.calls.add_(1)                                   # changes no output: only torch.export sees it
        return super().forward(x, total, bias, rng)


class ReservedName(Accumulator):
    state = [*Accumulator.state, BufferSpec("action", (2,), torch.float32, BufferKind.META)]

    def initial_state(self):
        return {**super().initial_state(), "action": torch.zeros(2)}


class LargeInitialState(Accumulator):
    """Non-zero initial values over the 64 MiB the metadata stores (16 Mi + 1 float32 ones, and bias)."""

    state = [*Accumulator.state, BufferSpec("table", (2**24 + 1,), torch.float32, BufferKind.META)]

    def initial_state(self):
        return {**super().initial_state(), "table": torch.ones(2**24 + 1)}

    def forward(self, x, total, bias, rng, table):
        return (*super().forward(x, total, bias, rng), table)


@pytest.mark.parametrize("broken, expect", [
    (NoInterface, r"lacks \['inputs', 'state', 'action_dim', 'chunk_horizon', 'initial_state'\]"),
    (WrongChunk, r"returns chunk as float32\[1, 2\]; it must be float32\[1, 1, 2\]"),
    (WritesItsState, r"writes its arguments in place; it must return the new state instead"),
    (PythonCounter, r"gave other outputs when called again .* keeps state outside its declared state"),
    (BufferCounter, r"forward writes \['calls'\] in place: state kept between steps must be declared"),
    (ReservedName, r"name 'action' is a standard buffer the runtime writes"),
    (LargeInitialState, r"initial_state\(\) has 67108876 bytes of non-zero values; at most 67108864 are stored"),
])
def test_modules_that_break_the_export_interface_are_refused_in_one_line(tmp_path, capsys, broken, expect):
    from capsule_ros.cli.main import main
    out = tmp_path / "broken.pt2"
    with pytest.raises(InterfaceError, match=expect):
        export_module(broken(), out)
    code = main(["export", "--module", f"{__name__}:{broken.__name__}", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("capsule-ros export: ") and not out.exists(), err


def test_initial_values_and_the_seeded_rng_are_kept_by_an_exported_program(tmp_path):
    module = Accumulator()
    path = tmp_path / "acc.pt2"
    report = export_module(module, path)
    assert report.mismatch is None, report.summary()
    runtime = build_policy_runtime(ExportedPolicy.from_file(path), RuntimeConfig(seed=7))
    assert runtime.arena["bias"].tolist() == [1.0, 1.0] and runtime.arena["rng"].tolist() == [7, 0]
    xs = np.random.default_rng(5).normal(size=(6, 3)).astype(np.float32)
    state = [torch.zeros(1, 3), torch.ones(1, 2), torch.tensor([[7, 0]])]
    for x in xs:
        runtime.staging["x"][:] = x
        runtime.load_inputs()
        runtime.step()
        with torch.no_grad():
            action, _, *state = module(torch.from_numpy(x[None]), *state)
        assert runtime.read_outputs().action.tobytes() == action[0].numpy().tobytes()


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_graph_captured_exported_step_equals_the_exported_module_run_eagerly_on_the_gpu(program):
    policy = ExportedPolicy.from_file(program)
    runtime = build_policy_runtime(policy, RuntimeConfig(device="cuda", cuda_graphs=True), mode=mode_for(policy))
    assert runtime.graphs.captured
    eager = ExportedPolicy.from_file(program).to("cuda")          # the programs, called in the module's own loop
    observe, plan, emit = (eager.programs[phase] for phase in ("observe", "plan", "emit"))
    state = [torch.zeros((1, *s.shape), dtype=s.dtype, device="cuda") for s in eager.interface.state]
    obs = observations(4 * HORIZON + 1, 6)
    served = step_all(runtime, obs)
    chunk = None
    with torch.inference_mode():
        for t, row in enumerate(obs):
            joints, goal = (torch.from_numpy(v[None]).cuda() for v in (row[:4], row[4:]))
            state = list(observe(joints, goal, *state))
            if t % HORIZON == 0:
                chunk = plan(state[0])
            rows = torch.clamp(t % HORIZON + torch.arange(HORIZON, device="cuda"), max=HORIZON - 1)
            action, upcoming, *state = emit(chunk[:, t % HORIZON], chunk[:, rows], *state)
            assert served[t][0].tobytes() == action[0].cpu().numpy().tobytes(), t
            assert served[t][1].tobytes() == upcoming[0].cpu().numpy().tobytes(), t


def test_bench_step_exported_times_the_served_program_against_the_eager_module():
    """`capsule-ros bench step --policy exported --quick` on the CPU (on a GPU it also times the CUDA graph)."""
    from capsule_ros.benchmarks.step import run_exported
    result = run_exported(torch.device("cpu"), True, "capsule_gru_policy.export:module")
    assert result["program"]["equals_module_bit_for_bit"] and result["exported_graph"] is None
    assert result["exported_eager"]["graph_captured"] is False
    assert result["speedup"] == result["eager_module"]["gpu_ms"]["p50"] / result["exported_eager"]["gpu_ms"]["p50"]
