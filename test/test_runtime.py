"""The graph runtime and capsules: byte-exact snapshot / restore, bit-identical replays,
forks, the KV-only ablation, fingerprint refusal, the KV ring's sliding window, prefill.
CPU tests run everywhere; ``cuda`` ones run the same checks with CUDA graphs on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_fixtures import (
    SMALL,
    arena_bytes,
    first_divergence,
    make_runtime,
    make_store,
    observations,
    run,
    with_overrides,
)

from capsule_ros.capsules.store import Tier
from capsule_ros.errors import ConfigError, FingerprintMismatch, InvalidArgument
from capsule_ros.policies.hybrid import chunked_scan
from capsule_ros.runtime.arena import KIND_ORDER, ArenaLayout, BufferKind, BufferSpec
from capsule_ros.runtime.builder import replica_of
from capsule_ros.runtime.engine import RuntimeConfig
from capsule_ros.runtime.graphs import GraphAddressError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def test_arena_is_one_allocation_grouped_by_kind_and_aligned():
    runtime = make_runtime()
    layout, arena = runtime.layout, runtime.arena
    kinds = [slot.spec.kind for slot in layout]
    assert kinds == sorted(kinds, key=KIND_ORDER.index)
    base = arena.storage.data_ptr()
    for slot in layout:
        view = arena[slot.spec.name]
        assert slot.offset % 256 == 0
        assert view.data_ptr() == base + slot.offset and view.untyped_storage().data_ptr() == base
        assert tuple(view.shape) == slot.spec.shape and view.dtype == slot.spec.dtype
    start, end = layout.byte_range(BufferKind.KV)
    assert all(start <= s.offset < end for s in layout if s.spec.kind == BufferKind.KV)
    with pytest.raises(InvalidArgument):
        ArenaLayout([BufferSpec("a", (1,), torch.float32, BufferKind.META)] * 2)
    with pytest.raises(InvalidArgument):
        layout.byte_range(BufferKind.INPUT, BufferKind.OUTPUT)   # not adjacent


@pytest.mark.parametrize("device", DEVICES)
def test_restore_is_byte_exact_after_dirtying_and_through_the_host_tier(device):
    runtime = make_runtime(device=device)
    store = make_store(runtime)
    run(runtime, observations(30, 1))
    before = arena_bytes(runtime)
    capsule = store.snapshot(runtime, episode_id=1, step=30)
    run(runtime, observations(50, 2))
    assert arena_bytes(runtime) != before
    store.restore(capsule.id, runtime)
    assert arena_bytes(runtime) == before
    store.move(capsule.id, Tier.HOST)
    assert store.get(capsule.id).tier == Tier.HOST
    run(runtime, observations(7, 3))
    store.restore(capsule.id, runtime)
    assert arena_bytes(runtime) == before
    assert store.counters.hits[Tier.HOST] == 1 and store.counters.hits[Tier.DEVICE] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_actions_after_restore_are_bit_identical_for_200_steps(device):
    runtime = make_runtime(device=device)
    store = make_store(runtime)
    run(runtime, observations(20, 4))
    capsule = store.snapshot(runtime, episode_id=1, step=20)
    obs = observations(200, 5)
    original = run(runtime, obs)
    store.restore(capsule.id, runtime)
    replay = run(runtime, obs)
    assert first_divergence(original, replay) is None


@pytest.mark.parametrize("device", DEVICES)
def test_fork_branches_are_identical_on_same_inputs_diverge_on_others_and_are_independent(device):
    main = make_runtime(device=device)
    store = make_store(main)
    run(main, observations(10, 6))
    capsule = store.snapshot(main, episode_id=1, step=10)
    branch = replica_of(main)
    assert branch.fingerprint == main.fingerprint and branch.arena.storage.data_ptr() != main.arena.storage.data_ptr()
    store.restore(capsule.id, branch)
    obs = observations(40, 7)
    a, b = run(main, obs), run(branch, obs)
    assert first_divergence(a, b) is None
    store.restore(capsule.id, main)
    store.restore(capsule.id, branch)
    branch_before = arena_bytes(branch)
    run(main, observations(25, 8))                       # stepping one branch ...
    assert arena_bytes(branch) == branch_before          # ... never touches the other
    store.restore(capsule.id, main)
    c, d = run(main, obs), run(branch, observations(40, 9))
    assert first_divergence(c, a) is None and first_divergence(c, d) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_kv_only_restore_diverges_because_recurrent_and_conv_state_are_load_bearing(device):
    runtime = make_runtime(device=device)
    store = make_store(runtime)
    run(runtime, observations(30, 10))
    capsule = store.snapshot(runtime, episode_id=1, step=30)
    obs = observations(20, 11)
    original = run(runtime, obs)
    store.restore(capsule.id, runtime, kinds=(BufferKind.KV,))
    ablated = run(runtime, obs)
    step = first_divergence(original, ablated)
    assert step is not None and step <= 3, f"KV-only restore first diverged at step {step}"
    assert np.abs(original - ablated).max() > 1e-3


def test_capsules_from_other_weights_or_shapes_are_refused_and_change_nothing():
    runtime = make_runtime(seed=0)
    store = make_store(runtime)
    run(runtime, observations(5, 12))
    capsule = store.snapshot(runtime, episode_id=1, step=5)
    for other in (make_runtime(seed=1), make_runtime(with_overrides(max_context=32)),
                  make_runtime(with_overrides(chunk_horizon=5))):
        run(other, observations(3, 13))
        before = arena_bytes(other)
        with pytest.raises(FingerprintMismatch):
            store.restore(capsule.id, other)
        assert arena_bytes(other) == before
    assert store.counters.invalidations == 3


def test_same_weights_same_fingerprint_and_identical_actions_across_runtimes():
    a, b = make_runtime(seed=3), make_runtime(seed=3)
    assert a.fingerprint == b.fingerprint
    obs = observations(30, 14)
    assert first_divergence(run(a, obs), run(b, obs)) is None
    assert make_runtime(seed=4).fingerprint != a.fingerprint


def test_kv_ring_is_a_sliding_window_at_its_limit():
    """Past max_context tokens, each step attends to exactly the last max_context tokens:
    the step path (ring buffer) matches the parallel path with a banded mask."""
    cfg = with_overrides(max_context=8, chunk_decay=0.0)
    runtime = make_runtime(cfg)
    obs = observations(3 * cfg.max_context, 15)
    with torch.no_grad():
        seq = runtime.policy.forward_sequence({"joints": torch.from_numpy(obs[None, :, :4]),
                                               "goal": torch.from_numpy(obs[None, :, 4:])})
    chunks = []
    for row in obs:
        runtime.staging["joints"][:] = row[:4]
        runtime.staging["goal"][:] = row[4:]
        runtime.load_inputs()
        runtime.step()
        chunks.append(runtime.read_outputs().chunk)
    np.testing.assert_allclose(np.stack(chunks), seq[0].numpy(), atol=2e-5)
    position = runtime.read_outputs().position
    assert position == 3 * cfg.max_context
    # and a model with a longer window gives different late actions (the window matters)
    wide = make_runtime(with_overrides(max_context=64, chunk_decay=0.0))
    assert first_divergence(run(wide, obs)[cfg.max_context:],
                            np.stack([c[0] for c in chunks])[cfg.max_context:]) is not None


@pytest.mark.parametrize("t,block", [(37, 8), (64, 16), (5, 64)])
def test_chunked_scan_matches_the_sequential_recurrence(t, block):
    gen = torch.Generator().manual_seed(t)
    b, h, p, n = 2, 3, 4, 5
    x = torch.randn(b, t, h, p, generator=gen, dtype=torch.float64)
    log_a = -torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    bb = torch.randn(b, t, n, generator=gen, dtype=torch.float64)
    cc = torch.randn(b, t, n, generator=gen, dtype=torch.float64)
    s0 = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
    y, final = chunked_scan(x, log_a, bb, cc, s0, block)
    s = s0.clone()
    ys = []
    for i in range(t):
        s = s * torch.exp(log_a[:, i])[..., None, None] + x[:, i, :, :, None] * bb[:, i, None, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", s, cc[:, i]))
    torch.testing.assert_close(y, torch.stack(ys, 1))
    torch.testing.assert_close(final, s)


def test_prefill_writes_the_ring_and_position_then_steps_deterministically():
    runtime = make_runtime()
    store = make_store(runtime)
    tokens = np.arange(20) % SMALL.vocab_size
    runtime.reset(episode=1)
    runtime.prefill(tokens)
    out = runtime.read_outputs()
    assert out.position == 20 and out.step == 0
    kv = runtime.arena["L2.kv"]
    assert kv[:, :, :20].abs().sum() > 0 and kv[:, :, 20:].abs().sum() == 0
    capsule = store.snapshot(runtime, episode_id=1, step=0)
    obs = observations(10, 16)
    cold = run(runtime, obs)
    runtime.reset(episode=1)
    runtime.prefill(tokens)
    assert first_divergence(run(runtime, obs), cold) is None      # prefill is deterministic
    store.restore(capsule.id, runtime)
    assert first_divergence(run(runtime, obs), cold) is None      # the capsule replaces it
    with pytest.raises(InvalidArgument):
        make_runtime(with_overrides(vocab_size=0)).prefill(tokens)


@pytest.mark.cuda
def test_cuda_graph_is_captured_and_the_address_check_catches_moved_buffers():
    runtime = make_runtime(device="cuda", debug_checks=True)
    assert runtime.graphs.captured
    run(runtime, observations(3, 17))
    runtime.arena._views["L0.ssm"] = runtime.arena["L0.ssm"].clone()   # a buffer that moved
    with pytest.raises(GraphAddressError):
        runtime.step()


@pytest.mark.cuda
def test_cuda_graph_replay_matches_the_eager_plan():
    graph = make_runtime(device="cuda", cuda_graphs=True, compile="off")
    eager = make_runtime(device="cuda", cuda_graphs=False, compile="off")
    obs = observations(50, 18)
    assert first_divergence(run(graph, obs), run(eager, obs)) is None


def test_float32_matmul_names_torchs_precisions_and_leaves_a_cpus_products_and_fingerprint_alone():
    """``runtime.float32_matmul``: an unknown precision is refused with the choices; on a
    CPU ``high`` changes neither the actions (TensorFloat-32 is a GPU's) nor the fingerprint,
    and leaves torch's CUDA flag as it was."""
    with pytest.raises(ConfigError, match=r"runtime.float32_matmul = 'medium': must be one of \['highest', 'high'\]"):
        RuntimeConfig(float32_matmul="medium")
    before = torch.backends.cuda.matmul.allow_tf32
    highest, high = make_runtime(), make_runtime(float32_matmul="high")
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert high.fingerprint == highest.fingerprint and high.identity.parts.kernel == "cpu"
    obs = observations(20, 21)
    assert first_divergence(run(high, obs), run(highest, obs)) is None


@pytest.mark.cuda
def test_tf32_on_a_gpu_is_its_own_kernel_kind_and_its_graphs_equal_its_eager_plan():
    """``float32_matmul: high`` on a GPU: the captured step equals the eager TF32 plan bit for
    bit, the actions differ from full float32's (TF32 is really on), and the fingerprint's
    kernel part says so, so a capsule of one is refused by the other (cause: kernel)."""
    obs = observations(50, 22)
    graph = make_runtime(device="cuda", compile="off", float32_matmul="high")
    eager = make_runtime(device="cuda", cuda_graphs=False, compile="off", float32_matmul="high")
    assert torch.backends.cuda.matmul.allow_tf32
    tf32 = run(graph, obs)
    assert first_divergence(tf32, run(eager, obs)) is None
    assert graph.identity.parts.kernel.endswith("+tf32")
    full = make_runtime(device="cuda", compile="off")
    assert not torch.backends.cuda.matmul.allow_tf32
    assert first_divergence(run(full, obs), tf32) is not None
    assert full.fingerprint != graph.fingerprint
    assert full.identity.parts.causes(graph.identity.parts) == ("kernel",)


@pytest.mark.parametrize("device", DEVICES)
def test_session_rollback_and_recompute_fallback_are_bit_identical(device, tmp_path):
    """The node's logic without ROS, on the device: commit, roll back, and rebuild a lost
    capsule from the input log (on the scratch runtime) give the original actions."""
    import dataclasses

    from runtime_fixtures import default_config

    from capsule_ros.serving.factory import build_session
    config = default_config(tmp_path)
    session = build_session(dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device=device)))
    obs = observations(60, 21)

    def feed(rows):
        out = []
        for row in rows:
            session.loop.write_input("joints", row[:4])
            session.loop.write_input("goal", row[4:])
            out.append(session.loop.tick().values)
        return np.stack(out)

    feed(obs[:20])
    capsule = session.verbs.commit("k", persist=True)
    original = feed(obs[20:])
    assert session.verbs.reenter(capsule.id).rollback
    assert first_divergence(feed(obs[20:]), original) is None
    session.parts.store.move(capsule.id, Tier.DISK)         # only its file is left ...
    path = tmp_path / "capsules" / f"{capsule.id}.capsule"
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0x10                                  # ... and it is damaged
    path.write_bytes(bytes(blob))
    result = session.verbs.reenter(capsule.id)
    assert result.fallback and result.recompute_seconds > 0 and "checksum" in result.fallback_reason
    assert first_divergence(feed(obs[20:]), original) is None


@pytest.mark.cuda
def test_cleanup_returns_the_gpu_memory(tmp_path):
    """The node's lifecycle without ROS, three times over with one StreamKeeper (as the
    node holds one): activate (arena, capture, capsule store) takes device memory; cleanup
    (``release``) gives it back. What stays is cuBLAS's workspace for the kept stream,
    allocated once: the loop does not grow. A fresh stream per cycle would leave 32 MiB
    behind each time (checked too, so the test shows what the keeper prevents). The node's
    cleanup, which leaves no captured graph behind, frees those workspaces as well: the
    memory is back at what it was before the first configure."""
    import dataclasses

    from runtime_fixtures import default_config

    from capsule_ros.runtime.engine import release_device_memory
    from capsule_ros.runtime.streams import StreamKeeper
    from capsule_ros.serving.factory import prepare_serving, start_session
    config = default_config(tmp_path)
    config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device="cuda"))
    device = torch.device("cuda")

    def cycle(streams: StreamKeeper, workspaces: bool = False) -> int:
        session = start_session(prepare_serving(config), streams=streams)
        for row in observations(5, 31):
            session.loop.write_input("joints", row[:4])
            session.loop.write_input("goal", row[4:])
            assert session.loop.tick() is not None
        session.verbs.commit()
        taken = torch.cuda.memory_allocated(device)
        session.release()
        del session
        release_device_memory(device, cublas_workspaces=workspaces)
        return taken

    # the baseline a fresh node process has: nothing of earlier tests in this process, their
    # cuBLAS workspaces included (their runtimes, and so their graphs, are gone)
    release_device_memory(device, cublas_workspaces=True)
    before = torch.cuda.memory_allocated(device)
    streams = StreamKeeper()
    left = []
    for _ in range(3):
        assert cycle(streams) - before > 1 * 2**20                      # activation did take memory
        left.append(torch.cuda.memory_allocated(device) - before)
    assert left[0] == left[1] == left[2], left                        # nothing accumulates
    assert left[0] <= 40 * 2**20, left                                 # at most the kept stream's workspace
    unkept = [cycle(StreamKeeper()) for _ in range(2)]                # a new stream each time: it grows
    assert torch.cuda.memory_allocated(device) - before > left[0], unkept
    for _ in range(2):                                                 # the node's cleanup: back to before
        assert cycle(streams, workspaces=True) - before > 1 * 2**20
        assert torch.cuda.memory_allocated(device) == before
