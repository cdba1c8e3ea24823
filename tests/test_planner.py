"""The hardware-aware planner: presets, predictions, memory budget, factorizations of one
axis (run exactly through the global API, with no data moved), and measured tuning."""

import dataclasses
import functools
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jax_seqpar
from jax_seqpar.tools import calibrate, hlo, tune
from jax_seqpar.planning import compute, hardware, plan as planner, predict, reasons, tuned
from jax_seqpar.core import reference
from jax_seqpar.core.meshes import split_axis
from jax_seqpar.core.masks import MaskSpec
from jax_seqpar.core.shape import LayerShape
from jax_seqpar.strategies import registry
from jax_seqpar.planning.plan import plan

GIB = 2.0**30
SHAPES = [  # (seq_len, heads, kv_heads, head_dim, v_head_dim, axis_sizes, causal, window)
    pytest.param(32768, 32, 8, 128, None, 8, True, None, id="gqa_8"),
    pytest.param(32768, 12, 12, 64, None, 8, True, None, id="12_heads_8"),
    pytest.param(131072, 128, 1, 576, 512, {"dcn": 4, "ici": 8}, True, None, id="mla_4x8"),
    pytest.param(65536, 16, 16, 64, None, {"dcn": 8, "ici": 8}, False, (4096, 0), id="window"),
    pytest.param(4096, 8, 8, 64, None, 1, False, None, id="one_device"),
]


@pytest.mark.parametrize("preset", sorted(hardware.PRESETS))
@pytest.mark.parametrize("seq_len, heads, kv_heads, head_dim, v_head_dim, axis_sizes, causal, "
                         "window", SHAPES)
def test_every_prediction_is_finite_and_positive(preset, seq_len, heads, kv_heads, head_dim,
                                                 v_head_dim, axis_sizes, causal, window):
    chosen = plan(seq_len, heads, kv_heads, head_dim, axis_sizes, v_head_dim=v_head_dim,
                  causal=causal, window=window, hardware=preset, memory_budget=1e15)
    devices = axis_sizes if isinstance(axis_sizes, int) else math.prod(axis_sizes.values())
    labels = {c.label for c in predict.candidates(devices, heads)}
    assert set(chosen.predicted_seconds) == set(chosen.memory_bytes) == labels
    for label, seconds in chosen.predicted_seconds.items():
        assert math.isfinite(seconds) and seconds > 0, label
        assert math.isfinite(chosen.memory_bytes[label]) and chosen.memory_bytes[label] > 0
    seconds = chosen.predicted_seconds
    tied = [label for label, s in seconds.items()
            if s <= min(seconds.values()) * (1 + reasons.TIE)]
    if len(tied) == 1:  # one fastest: said to be so
        assert tied[0] in chosen.reason and f"fastest predicted on {preset}" in chosen.reason
    else:  # a tie: said to be one, won by the fewest bytes
        assert f"a tie on {preset}, {len(tied)} candidates" in chosen.reason
        fewest = min(tied, key=chosen.candidates.__getitem__)
        assert chosen.reason.startswith(fewest + ":")
    assert chosen.factorization[0] * chosen.factorization[1] == devices


def test_twelve_heads_on_eight_offers_the_ulysses_4_hybrid():
    """The old planner could only say ring (12 % 8 != 0); USP's 2 x 4 is offered now,
    faster than the ring (its inner exchange in pieces that hide behind the ring's
    steps), and chosen where the all-gather's O(S) K/V does not fit."""
    offered = plan(32768, 12, 12, 64, {"sp": 8}, causal=True, hardware="tpu-v5p")
    assert {"ring", "allgather", "hybrid 2x4", "hybrid 4x2"} == set(offered.predicted_seconds)
    assert "ulysses" not in offered.predicted_seconds
    times = offered.predicted_seconds
    assert max(times["allgather"], min(times["hybrid 2x4"], times["hybrid 4x2"])) < times["ring"]
    budget = (offered.memory_bytes["allgather"] + offered.memory_bytes["ring"]) / 2
    chosen = plan(32768, 12, 12, 64, {"sp": 8}, causal=True, hardware="tpu-v5p",
                  memory_budget=budget)
    assert chosen.strategy == "hybrid" and chosen.seq_axes == "sp"  # split on one axis
    assert chosen.ulysses_size == chosen.factorization[1] in (2, 4)


def test_memory_budget_rejects_allgather_at_long_sequences():
    args = (1 << 20, 32, 8, 128, 8)
    unlimited = plan(*args, causal=True, hardware="h100", memory_budget=1e15)
    gathered, ring = unlimited.memory_bytes["allgather"], unlimited.memory_bytes["ring"]
    assert gathered > 1.5 * ring  # O(S) K/V and its cotangent against O(S/P)
    budget = (gathered + ring) / 2
    chosen = plan(*args, causal=True, hardware="h100", memory_budget=budget)
    assert "allgather" in chosen.rejected and "allgather" not in chosen.predicted_seconds
    assert f"over the budget of {budget / GIB:.3g} GiB" in chosen.rejected["allgather"]
    assert "over the memory budget: allgather" in chosen.reason
    assert chosen.strategy != "allgather"
    with pytest.raises(ValueError, match="every candidate is over the memory budget"):
        plan(*args, hardware="h100", memory_budget=1024.0)


def test_memory_grows_with_s_over_p_except_allgather():
    def memory(seq_len):
        return plan(seq_len, 32, 8, 128, 8, hardware="h100", memory_budget=1e15).memory_bytes

    short, long = memory(1 << 16), memory(1 << 18)
    for label in short:
        assert long[label] / short[label] == pytest.approx(4, rel=0.1), label


def test_causal_halves_and_window_cuts_the_compute():
    shape = dict(batch=1, seq_len=1 << 16, num_heads=8, num_kv_heads=8, head_dim=128,
                 v_head_dim=128)
    candidate = predict.Candidate("ulysses", 1, 8)
    full = predict.predict(candidate, LayerShape(**shape), hardware.H100)["compute_seconds"]
    causal = predict.predict(candidate, LayerShape(**shape, causal=True),
                             hardware.H100)["compute_seconds"]
    window = predict.predict(candidate, LayerShape(**shape, causal=True, window=(1024, 0)),
                             hardware.H100)["compute_seconds"]
    assert causal / full == pytest.approx(0.5, abs=0.01)
    assert window / full < 0.05


@pytest.mark.parametrize("seq_len, causal, window", [
    (37, False, None), (37, True, None), (37, False, (3, 5)), (37, True, (4, 9)),
    (8, True, (100, 100))])
def test_visible_pairs_counts_the_mask(seq_len, causal, window):
    positions = np.arange(seq_len)
    query, key = positions[:, None], positions[None, :]
    seen = np.ones((seq_len, seq_len), bool)
    if causal:
        seen &= key <= query
    if window:
        seen &= (key >= query - window[0]) & (key <= query + window[1])
    spec = MaskSpec.make(causal=causal, window=window)
    assert compute.visible_pairs(seq_len, spec) == seen.sum()


def test_ring_hides_hops_behind_compute_only_where_the_hardware_overlaps():
    shape = LayerShape(1, 1 << 16, 32, 32, 128, causal=True)
    ring = predict.Candidate("ring", 8, 1)
    overlapped = predict.predict(ring, shape, hardware.H100)
    serial = predict.predict(ring, shape, hardware.H100.replace(overlaps=()))
    # hops hidden but the last
    assert overlapped["exposed_comm_seconds"] < 0.05 * overlapped["compute_seconds"]
    assert serial["seconds"] > overlapped["seconds"] + 0.5 * serial["exposed_comm_seconds"]
    # Overlap changes what is exposed, not what is sent or how long the links are busy.
    assert serial["comm_seconds"] == pytest.approx(overlapped["comm_seconds"])
    assert serial["exposed_comm_seconds"] == pytest.approx(serial["comm_seconds"])
    slow_links = hardware.H100.replace(devices_per_domain=1)  # every hop on InfiniBand
    assert predict.predict(ring, shape, slow_links)["seconds"] >= overlapped["seconds"]


def test_exchanges_in_pieces_hide_where_the_target_overlaps_their_kind(monkeypatch):
    """An exchange sent whole is never hidden; sent in the strategy's pieces (the
    all-gather: K/V in 16 pieces at 8192 tokens a device, dK/dV in 8 hops around the
    ring), each piece after the first hides behind the kernels where the target overlaps
    its kind (GPU and TPU both overlap all-gathers and collective-permutes; CPU none)."""
    shape = LayerShape(1, 1 << 16, 32, 8, 128, dtype="bfloat16", causal=True)
    gather = predict.Candidate("allgather", 8, 1)
    forward_bytes = predict.predict(gather, shape.replace(backward=False), "h100")["bytes"]
    assert registry.get("allgather").pieces(shape, 8, 1) == (16, 8)
    pieced = {name: predict.predict(gather, shape, name) for name in ("h100", "tpu-v5p")}
    for p in pieced.values():
        assert p["hidden_bytes"] == pytest.approx(
            forward_bytes * 15 / 16 + (p["bytes"] - forward_bytes) * 7 / 8)
    monkeypatch.setitem(registry.STRATEGIES, "allgather",
                        dataclasses.replace(registry.get("allgather"), pieces=None))
    whole = {name: predict.predict(gather, shape, name) for name in ("h100", "tpu-v5p")}
    assert all(p["hidden_bytes"] == 0 for p in whole.values())
    assert all(p["exposed_comm_seconds"] == pytest.approx(p["comm_seconds"])
               for p in whole.values())
    for name in whole:
        assert whole[name]["seconds"] > pieced[name]["seconds"] >= pieced[name][
            "compute_seconds"]
    monkeypatch.undo()
    cpu = predict.predict(gather, shape, hardware.CPU)  # overlaps nothing
    assert cpu["hidden_bytes"] == 0


@pytest.mark.parametrize("strategy, factors", [
    ("ulysses", (1, 16)), ("allgather", (16, 1)), ("ring", (16, 1)), ("hybrid", (2, 8))])
@pytest.mark.parametrize("segment_ids", [False, True])
def test_collectives_cost_one_latency_per_step(strategy, factors, segment_ids):
    """Links' alpha-beta terms add up: an all_to_all is one step, an all_gather or
    reduce-scatter P-1 (Ulysses' gathered positions too), a ring hop one; two nodes of 8."""
    shape = LayerShape(2, 4096, 16, 4, 64, causal=True, segment_ids=segment_ids)
    model = hardware.H100.replace(devices_per_domain=8)
    result = predict.predict(predict.Candidate(strategy, *factors), shape, model)
    ici, dcn = model.ici, model.dcn
    assert result["ici_bytes"] + result["dcn_bytes"] == pytest.approx(result["bytes"])
    gathers = 1 + segment_ids
    if strategy == "ulysses":  # 16 devices, 2 nodes: 1/15 of the bytes stay in the node
        steps = 8 + 15 * gathers
        expected = steps * dcn.latency + max(result["ici_bytes"] / ici.bandwidth,
                                             result["dcn_bytes"] / dcn.bandwidth)
        assert result["ici_bytes"] == pytest.approx(result["bytes"] * 7 / 15)
    elif strategy == "allgather":  # gather k, v, positions (+ ids); dK/dV 16 hops
        expected = (15 * (3 + segment_ids) + 16) * dcn.latency + max(
            result["ici_bytes"] / ici.bandwidth, result["dcn_bytes"] / dcn.bandwidth)
    elif strategy == "ring":  # 15 hops forward, 16 backward, all on the slow link
        expected = 31 * dcn.latency + result["bytes"] / dcn.bandwidth
        assert result["ici_bytes"] == 0
    else:  # Ulysses over the 8 of a node, then a ring of 2 nodes: 1 hop + 2 back
        a2a = (8 + 7 * gathers) * ici.latency + result["ici_bytes"] / ici.bandwidth
        expected = a2a + 3 * dcn.latency + result["dcn_bytes"] / dcn.bandwidth
    assert result["comm_seconds"] == pytest.approx(expected)
    assert result["seconds"] == pytest.approx(result["compute_seconds"]
                                              + result["exposed_comm_seconds"])


def test_one_device_sends_and_waits_for_nothing():
    shape = LayerShape(1, 4096, 8, 8, 64)
    for candidate in predict.candidates(1, 8):
        result = predict.predict(candidate, shape, "h100")
        assert result["bytes"] == result["comm_seconds"] == 0.0, candidate.label
        assert result["seconds"] == result["compute_seconds"], candidate.label


def test_hardware_presets_and_lookup():
    assert hardware.get("H100") is hardware.H100
    assert hardware.get(hardware.A100) is hardware.A100
    assert hardware.for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware.for_device_kind("TPU v5 lite").name == "tpu-v5e"
    assert hardware.for_device_kind("TPU v5p").name == "tpu-v5p"
    assert hardware.for_device_kind("TPU v6 lite").name == "tpu-v6e"
    assert hardware.for_device_kind("cpu").name == "cpu"
    assert hardware.for_device_kind("Some Accelerator") is None
    assert hardware.H100.link(8) is hardware.H100.ici
    assert hardware.H100.link(2, stride=8) is hardware.H100.dcn
    with pytest.raises(ValueError, match="hardware='b200' is not a Hardware or one of"):
        hardware.get("b200")
    with pytest.raises(ValueError, match="attention_efficiency must be in"):
        hardware.H100.replace(attention_efficiency=0)
    with pytest.raises(ValueError, match="Link bandwidths must be positive"):
        hardware.Link(0.0, 1e-6)


# --- splitting one axis: same devices, no data moved, exact ----------------------------

@pytest.mark.parametrize("names, shape, axes", [
    (("sp",), (8,), "sp"), (("dp", "sp"), (2, 4), "sp"), (("sp", "tp"), (4, 2), "sp"),
    (("a", "b"), (4, 2), ("a", "b")), (("dp", "a", "b"), (2, 2, 2), ("a", "b"))])
def test_split_axis_keeps_every_shard_on_its_device(names, shape, axes):
    """In place: every shard on its device, and the devices in the mesh's order (one
    program holds both meshes only then)."""
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    mesh2d, (ring, ulysses) = split_axis(mesh, axes, 2)
    seq = (axes,) if isinstance(axes, str) else axes
    old = NamedSharding(mesh, P(None, seq)).devices_indices_map((4, 64))
    new = NamedSharding(mesh2d, P(None, (ring, ulysses))).devices_indices_map((4, 64))
    assert old == new
    assert mesh2d.shape[ulysses] == 2
    assert list(mesh2d.devices.flat) == list(mesh.devices.flat)


def test_split_axis_refuses_sequence_axes_that_are_not_neighbours():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("a", "dp", "b"))
    with pytest.raises(ValueError, match=r"seq_axes=\('a', 'b'\) must be neighbouring axes"):
        split_axis(mesh, ("a", "b"), 4)
    with pytest.raises(ValueError, match="must be neighbouring axes"):
        split_axis(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), ("b", "a"), 2)


def test_split_axis_passes_a_matching_two_axis_mesh_and_refuses_bad_sizes():
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"))
    assert split_axis(mesh, ("dcn", "ici"), 4) == (mesh, ("dcn", "ici"))
    with pytest.raises(ValueError, match=r"ulysses_size=3 must be a positive divisor of the 8 "
                                         r"sequence devices.*\[1, 2, 4, 8\]"):
        split_axis(mesh, ("dcn", "ici"), 3)
    with pytest.raises(ValueError, match="seq axis 'sp' is not an axis"):
        split_axis(mesh, "sp", 2)


def test_hybrid_with_ulysses_size_on_one_axis_is_exact(make_qkv, tolerances):
    """12 heads on 8 devices: Ulysses over 4 neighbours x ring over 2, forward and grads."""
    q, k, v = make_qkv(batch=1, seq=64, heads=12, kv_heads=6, head_dim=8, seed=3)
    mesh = jax.make_mesh((8,), ("sp",))
    attend = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh,
                               strategy="hybrid", ulysses_size=4, causal=True)

    def loss(attention, q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v)))

    out, grads = jax.jit(jax.value_and_grad(functools.partial(loss, attend), (0, 1, 2)))(q, k, v)
    ref_attention = functools.partial(reference.attention, causal=True)
    ref_out, ref_grads = jax.value_and_grad(functools.partial(loss, ref_attention),
                                            (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref_out, **tolerances(q.dtype))
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.shape == ref_grad.shape
        np.testing.assert_allclose(grad, ref_grad, **tolerances(q.dtype, "grad"))
    sharded = jax.device_put(q, NamedSharding(mesh, P(None, "sp")))
    assert jax.jit(attend)(sharded, sharded, sharded).sharding.mesh.shape == {"sp": 8}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_split_hybrid_sends_what_a_native_two_axis_mesh_sends(axis_type, make_qkv,
                                                               tolerances):
    """Resharding onto the split mesh adds no collective: same HLO bytes as a (2, 4) mesh."""
    q, _, _ = make_qkv(batch=1, seq=128, heads=12, head_dim=8)

    def compiled(shape, names, seq_axes, **kwargs):
        mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
        attend = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh,
                                   seq_axes=seq_axes, strategy="hybrid", causal=True, **kwargs)
        x = jax.device_put(q, NamedSharding(mesh, P(None, seq_axes)))
        return jax.jit(attend).lower(x, x, x).compile(), x

    native, _ = compiled((2, 4), ("dcn", "ici"), ("dcn", "ici"))
    split, x = compiled((8,), ("sp",), "sp", ulysses_size=4)
    sent = hlo.collective_bytes(split)
    assert sent == hlo.collective_bytes(native) and sum(sent.values()) > 0
    np.testing.assert_allclose(split(x, x, x), reference.attention(q, q, q, causal=True),
                               **tolerances(q.dtype))


def test_ulysses_size_needs_the_hybrid(make_qkv):
    q, k, v = make_qkv(batch=1, seq=64, heads=4, head_dim=8)
    with pytest.raises(ValueError, match='ulysses_size=2 needs strategy="hybrid"'):
        jax_seqpar.sequence_parallel_attention(q, k, v, mesh=jax.make_mesh((8,), ("sp",)),
                                               strategy="ring", ulysses_size=2)


# --- measured tuning and its cache ----------------------------------------------------

def test_tuned_plan_is_stored_and_reused_by_auto_on_request(tmp_path, monkeypatch, make_qkv,
                                                            tolerances):
    cache = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(cache))
    mesh = jax.make_mesh((8,), ("sp",))
    chosen = tune.tune(128, 4, 4, 8, mesh, causal=True, dtype_bytes=4, top=1, runs=1)
    (label, seconds), = chosen.measured_seconds.items()
    assert seconds > 0 and label == min(chosen.predicted_seconds,
                                        key=chosen.predicted_seconds.get)
    assert "fastest measured on this mesh" in chosen.reason
    (key, entry), = json.loads(cache.read_text()).items()
    assert entry["label"] == label

    # auto reuses the stored entry, whatever the model says: make it all-gather
    entry.update(strategy="allgather", ulysses_size=None, label="allgather")
    cache.write_text(json.dumps({key: entry}))
    q, k, v = make_qkv(batch=1, seq=128, heads=4, head_dim=8)
    layer = LayerShape(*q.shape[:3], 4, 8, dtype=q.dtype, causal=True)
    assert planner.auto_choice(layer, mesh, ("sp",)) == ("allgather", None)
    monkeypatch.delenv(tuned.ENV_VAR)  # not asked for: the file is not read
    assert planner.auto_choice(layer, mesh, ("sp",))[0] != "allgather"
    monkeypatch.setenv(tuned.ENV_VAR, str(cache))
    attend = functools.partial(jax_seqpar.sequence_parallel_attention, mesh=mesh, causal=True)
    compiled = jax.jit(attend).lower(q, k, v).compile()
    sent = hlo.collective_bytes(compiled)
    assert sent["all-gather"] > 0 and sent["all-to-all"] == 0
    np.testing.assert_allclose(compiled(q, k, v),
                               reference.attention(q, k, v, causal=True), **tolerances(q.dtype))


def test_auto_without_a_cache_entry_uses_the_device_preset(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "empty.json"))
    mesh = jax.make_mesh((8,), ("sp",))
    layer = LayerShape(1, 1024, 12, 12, 64, dtype="float32", causal=True)
    strategy, ulysses_size = planner.auto_choice(layer, mesh, ("sp",))
    expected = plan(1024, 12, 12, 64, {"sp": 8}, dtype_bytes=4, causal=True, hardware="cpu")
    assert (strategy, ulysses_size) == (expected.strategy, expected.ulysses_size)


def test_unreadable_cache_is_an_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not readable JSON"):
        tuned.lookup("key", cache=bad)


def test_calibrated_cpu_preset_is_measured():
    cpu = calibrate.calibrate_cpu(runs=1, matmul_size=64,
                                  attention_shape=(256, 2, 16),
                                  message_bytes=(2**12, 2**16), repeats=2)
    assert cpu.name == "cpu" and not cpu.overlap
    for value in (cpu.peak_flops, cpu.ici.bandwidth, cpu.ici.collective_bandwidth,
                  cpu.attention_efficiency):
        assert math.isfinite(value) and value > 0
    assert plan(4096, 8, 8, 64, 8, hardware=cpu).predicted_seconds


def test_tune_command(tmp_path, capsys):
    from jax_seqpar.tools.cli import main

    cache = tmp_path / "cli.json"
    assert main(["tune", "--seq", "128", "--heads", "4", "--kv-heads", "4", "--head-dim", "8",
                 "--top", "1", "--runs", "1", "--cache", str(cache)]) == 0
    text = capsys.readouterr().out
    assert "fastest measured on this mesh" in text and str(cache) in text
    assert len(json.loads(cache.read_text())) == 1
    assert main(["tune", "--mesh", "sp=3", "--cache", str(cache)]) == 2
    assert "seq_len=4096 is not divisible by the 3 devices" in capsys.readouterr().err


def test_auto_says_once_what_it_chose(caplog):
    """``strategy="auto"`` says on the ``jax_seqpar`` logger (INFO), once per layer, mask
    and mesh (not on the calls after), the strategy and order it took and why: every
    candidate's predicted time, bytes and memory."""
    from jax_seqpar.api import attention

    attention._announced.cache_clear()
    mesh = jax.make_mesh((8,), ("sp",))
    q = jnp.ones((1, 8 * 24, 8, 16), jnp.float32)
    with caplog.at_level(logging.INFO, logger="jax_seqpar"):
        for _ in range(3):
            jax_seqpar.sequence_parallel_attention(q, q, q, mesh=mesh, causal=True)
        jax.jit(lambda q: jax_seqpar.sequence_parallel_attention(q, q, q, mesh=mesh,
                                                                 causal=True))(q)
    records = [r for r in caplog.records if r.name == "jax_seqpar"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    message = records[0].getMessage()
    strategy, ulysses_size = planner.auto_choice(
        LayerShape(1, 8 * 24, 8, 8, 16, dtype=jnp.float32, causal=True), mesh, ("sp",))
    assert f"): {strategy}" in message and 'layout="auto" -> ' in message
    for label in ("ulysses", "ring", "allgather"):
        assert message.count(label) >= 3  # its time, bytes and memory
    with caplog.at_level(logging.INFO, logger="jax_seqpar"):  # another mask: said again
        jax_seqpar.sequence_parallel_attention(q, q, q, mesh=mesh, causal=True, window=8)
    assert len([r for r in caplog.records if r.name == "jax_seqpar"]) == 2


def test_a_tie_is_said_to_be_a_tie_and_goes_to_fewest_bytes():
    """Candidates predicted within ``reasons.TIE`` of the fastest are a tie: the plan says
    so, names them, and takes the one that sends fewest bytes."""
    choice = planner.plan(seq_len=131072, num_heads=32, num_kv_heads=8, head_dim=128,
                          axis_sizes={"sp": 8}, causal=True, hardware="h100")
    seconds = choice.predicted_seconds
    tied = [label for label, s in seconds.items()
            if s <= min(seconds.values()) * (1 + reasons.TIE)]
    assert len(tied) > 1, seconds  # this layer is compute-bound on h100: a tie
    fewest = min(tied, key=choice.candidates.__getitem__)
    assert choice.strategy == fewest.split()[0]
    assert f"a tie on h100, {len(tied)} candidates" in choice.reason
    assert "the tie goes to the fewest bytes sent" in choice.reason
    assert "fastest predicted" not in choice.reason


def _computed_tiles(q_positions, kv_positions, window, tile=compute.TILE):
    """Tiles a kernel computes for one call, by the rule every kernel uses (a tile is
    skipped when its position ranges rule out every pair): causal, ``(left, 0)`` window."""
    def ranges(positions):
        tiles = positions.reshape(-1, min(tile, positions.size))
        return tiles.min(axis=1)[:, None], tiles.max(axis=1)[:, None]

    (q_lo, q_hi), (k_lo, k_hi) = ranges(q_positions), ranges(kv_positions)
    k_lo, k_hi = k_lo.T, k_hi.T
    empty = (k_lo > q_hi) | (k_hi < q_lo - window[0])
    return int((~empty).sum())


def test_ulysses_sequence_pieces_are_counted_in_their_token_order():
    """Ulysses' pipeline gathers every piece device by device, so a kernel call's tiles
    mix far-apart tokens and a window empties few of them: the model counts the tiles of
    every call in that order (523 at S=8192 over 8 devices, not the contiguous order's
    150), the backward's dq and dK/dV calls each at the products they recompute."""
    seq_len, devices, heads, dim, window = 8192, 8, 8, 64, (1024, 0)
    shape = LayerShape(1, seq_len, heads, heads, dim, dtype=jnp.bfloat16, causal=True,
                       window=window)
    local_len = seq_len // devices
    pieces = 5  # what pieces="auto" takes at 1024 tokens a device over 8
    sizes = (64, 256, 256, 256, 128, 64)  # heads.piece_sizes(1024, 5)
    starts = np.cumsum((0,) + sizes[:-1])

    def gathered(start, size):  # one piece's all-to-all: device 0's tokens, device 1's, ...
        return np.concatenate([d * local_len + np.arange(start, start + size)
                               for d in range(devices)])

    queries = [gathered(o, s) for o, s in zip(starts, sizes)]
    keys = [gathered(o, 64) for o in range(0, local_len, 64)]
    all_queries, all_keys = np.concatenate(queries), np.concatenate(keys)
    forward = (sum(_computed_tiles(queries[0], kv, window) for kv in keys)
               + sum(_computed_tiles(q, all_keys, window) for q in queries[1:]))
    dq = sum(_computed_tiles(q, all_keys, window) for q in queries)
    dkv = sum(_computed_tiles(all_queries, kv, window) for kv in keys)
    contiguous = _computed_tiles(np.arange(seq_len), np.arange(seq_len), window)
    assert (forward, contiguous) == (523, 150)

    ulysses = registry.get("ulysses")
    assert ulysses.pieces(shape, 1, devices) == (2 ** (pieces - 1),) * 2
    flops_per_pair = 2 * (heads // devices) * 2 * dim
    ratio = 5 / 2  # (3 Dqk + 2 Dv) / (Dqk + Dv)
    # dq computes S, dP and dQ (3 products a pair), dK/dV S, dP, dV and dK (4): of a whole
    # call's 5 in the XLA kernel's fused loop (cpu), of 7 in two kernels (h100)
    for preset, whole in ((hardware.CPU, 5), (hardware.H100, 7)):
        fwd, bwd = compute.step_seconds(ulysses, 1, devices, shape, preset, compute.TILE)
        to_tiles = preset.attention_flops / flops_per_pair / compute.TILE ** 2
        assert fwd[0] * to_tiles == pytest.approx(forward)
        assert bwd[0] * to_tiles == pytest.approx(ratio * (3 * dq + 4 * dkv) / whole)
    # The ring attends its own contiguous shards: no pieces, the contiguous order.
    ring = registry.get("ring")
    assert ring.kernel_calls is None
    fwd, _ = compute.step_seconds(ring, devices, 1, shape, hardware.CPU, compute.TILE)
    to_tiles = hardware.CPU.attention_flops / (2 * heads * 2 * dim) / compute.TILE ** 2
    assert sum(fwd) * to_tiles * devices >= contiguous


def test_auto_picks_the_halo_ring_for_a_window_on_the_cpu_mesh(tmp_path, monkeypatch):
    """On the 8 emulated CPU devices a causal window of 1024 at S=8192 runs 3-4x faster as
    the ring's halo exchange than as Ulysses (``experiments/window_auto_time.py``), whose
    pieces leave the window few tiles to skip: ``strategy="auto"`` takes the ring, which
    sends only the halo."""
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "empty.json"))
    mesh = jax.make_mesh((8,), ("sp",))
    assert hardware.for_device_kind(mesh.devices.flat[0].device_kind) is hardware.CPU
    for backward in (False, True):
        layer = LayerShape(1, 8192, 8, 8, 64, dtype=jnp.bfloat16, causal=True,
                           window=(1024, 0), backward=backward)
        assert planner.auto_choice(layer, mesh, ("sp",)) == ("ring", None)
        chosen = planner.plan_layer(layer, {"sp": 8}, hardware="cpu")
        seconds = chosen.predicted_seconds
        assert seconds["ulysses"] > 3 * seconds["ring"]
        # The halo: the window's 1024 keys of one neighbour, not the whole ring's K/V.
        whole = registry.comm_bytes("ring", axis_sizes=8,
                                    **layer.replace(window=None).comm_kwargs())
        assert chosen.bytes_per_device < whole / 4
        assert chosen.bytes_per_device < chosen.candidates["ulysses"]
