"""jax_seqpar.tools.hlo: bytes read from compiled programs equal hand-computed values exactly.

Programs run on the 8 emulated CPU devices. What XLA's CPU backend emits, checked with
``jax.jit(f).lower(x).compile().as_text()``: every collective stays a collective (none
is rewritten into another kind); ``all_to_all`` becomes a tuple-shaped all-to-all of P
slices (summed); ``fori_loop``/``scan`` become ``while`` loops with a
``known_trip_count``; bf16 collectives are promoted to f32 (see ``test_cpu_promotes_bf16``).
Async ``*-start``/``*-done`` pairs and iota replica groups do not appear on CPU, so they
are checked on hand-written GPU-style HLO text.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jax_seqpar.tools import hlo

# Every program below takes the global f32[64, 16]; each of the 8 devices holds
# f32[8, 16] = 512 bytes (f32[16, 16] = 1024 bytes on the 4 devices of an inner group).
GLOBAL_SHAPE = (64, 16)
LOCAL_BYTES = 8 * 16 * 4
RING = [(i, (i + 1) % 8) for i in range(8)]


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()), ("sp",))


@pytest.fixture(scope="module")
def mesh2x4():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("outer", "inner"))


def _sharded(fn, mesh, num_args=1):
    spec = P(tuple(mesh.axis_names))
    specs = (spec,) * num_args
    return jax.shard_map(fn, mesh=mesh, in_specs=specs if num_args > 1 else spec,
                         out_specs=specs if num_args > 1 else spec)


def _collective_bytes(fn, *args, **kwargs):
    return hlo.collective_bytes(jax.jit(fn).lower(*args).compile(), **kwargs)


def _only(kind, value):
    expected = dict.fromkeys(hlo.COLLECTIVE_KINDS, 0.0)
    expected[kind] = value
    return expected


x = jnp.ones(GLOBAL_SHAPE, jnp.float32)


@pytest.mark.parametrize("collective, kind, expected", [
    pytest.param(lambda x: lax.all_to_all(x, "sp", 1, 0, tiled=True),
                 "all-to-all", LOCAL_BYTES * 7 / 8, id="all_to_all"),
    pytest.param(lambda x: lax.all_gather(x, "sp", tiled=True),  # output f32[64, 16]
                 "all-gather", 8 * LOCAL_BYTES * 7 / 8, id="all_gather"),
    pytest.param(lambda x: lax.psum(x, "sp"),
                 "all-reduce", 2 * LOCAL_BYTES * 7 / 8, id="psum"),
    pytest.param(lambda x: lax.psum_scatter(x, "sp", scatter_dimension=0, tiled=True),
                 "reduce-scatter", LOCAL_BYTES * 7 / 8, id="psum_scatter"),
    pytest.param(lambda x: lax.ppermute(x, "sp", RING),
                 "collective-permute", LOCAL_BYTES, id="ppermute"),
])
def test_one_collective(mesh, collective, kind, expected):
    assert _collective_bytes(_sharded(collective, mesh), x) == _only(kind, expected)


@pytest.mark.parametrize("collective, kind, expected", [
    # Groups {{0,1,2,3},{4,5,6,7}}: P = 4; each device holds f32[8, 16].
    pytest.param(lambda x: lax.psum(x, "inner"),
                 "all-reduce", 2 * LOCAL_BYTES * 3 / 4, id="psum_inner"),
    pytest.param(lambda x: lax.psum_scatter(x, "inner", scatter_dimension=0, tiled=True),
                 "reduce-scatter", LOCAL_BYTES * 3 / 4, id="psum_scatter_inner"),
    pytest.param(lambda x: lax.all_gather(x, "inner", tiled=True),
                 "all-gather", 4 * LOCAL_BYTES * 3 / 4, id="all_gather_inner"),
    # Groups {{0,4},{1,5},{2,6},{3,7}}: P = 2.
    pytest.param(lambda x: lax.all_to_all(x, "outer", 1, 0, tiled=True),
                 "all-to-all", LOCAL_BYTES / 2, id="all_to_all_outer"),
    pytest.param(lambda x: lax.all_gather(x, "outer", tiled=True),
                 "all-gather", 2 * LOCAL_BYTES / 2, id="all_gather_outer"),
    # Both axes: one group of 8.
    pytest.param(lambda x: lax.psum(x, ("outer", "inner")),
                 "all-reduce", 2 * LOCAL_BYTES * 7 / 8, id="psum_both"),
])
def test_grouped_collective(mesh2x4, collective, kind, expected):
    assert _collective_bytes(_sharded(collective, mesh2x4), x) == _only(kind, expected)


def test_tuple_and_mixed_dtypes(mesh):
    """A collective over a pytree counts every leaf with its own element size."""
    ids = jnp.ones((64, 4), jnp.int32)  # s32[8, 4] = 128 bytes per device

    def fn(x, ids):
        return lax.psum((x, ids), "sp")

    assert _collective_bytes(_sharded(fn, mesh, 2), x, ids) == _only(
        "all-reduce", 2 * (LOCAL_BYTES + 128) * 7 / 8)


def test_cpu_promotes_bf16(mesh):
    """XLA:CPU upcasts bf16 collectives to f32; the compiled program is what we count."""
    text = jax.jit(_sharded(lambda x: lax.ppermute(x, "sp", RING), mesh)).lower(
        x.astype(jnp.bfloat16)).compile().as_text()
    sent = hlo.collective_bytes(text)["collective-permute"]
    element_bytes = 4 if jax.default_backend() == "cpu" else 2
    assert sent == 8 * 16 * element_bytes


@pytest.mark.parametrize("trips", [1, 5])
def test_fori_loop_counts_every_iteration(mesh, trips):
    def fn(x):
        return lax.fori_loop(0, trips, lambda i, c: lax.ppermute(c, "sp", RING), x)

    assert _collective_bytes(_sharded(fn, mesh), x) == _only(
        "collective-permute", trips * LOCAL_BYTES)


def test_scan_with_tuple_carry(mesh):
    ids = jnp.ones((64, 4), jnp.int32)

    def fn(x, ids):
        def step(carry, _):
            return lax.ppermute(carry, "sp", RING), None

        return lax.scan(step, (x, ids), length=7)[0]

    assert _collective_bytes(_sharded(fn, mesh, 2), x, ids) == _only(
        "collective-permute", 7 * (LOCAL_BYTES + 128))


def test_nested_loops_multiply(mesh):
    def fn(x):
        def outer(i, c):
            inner = lax.fori_loop(0, 3, lambda j, d: lax.ppermute(d, "sp", RING), c)
            return lax.psum(inner, "sp") - inner  # varying again, as the carry must be

        return lax.fori_loop(0, 5, outer, x)

    expected = dict.fromkeys(hlo.COLLECTIVE_KINDS, 0.0)
    expected["collective-permute"] = 5 * 3 * LOCAL_BYTES
    expected["all-reduce"] = 5 * 2 * LOCAL_BYTES * 7 / 8
    assert _collective_bytes(_sharded(fn, mesh), x) == expected


def test_unknown_trip_count_is_an_error(mesh):
    def fn(x):
        def body(carry):
            c, n = carry
            return lax.ppermute(c, "sp", RING), n + 1

        return lax.while_loop(lambda carry: carry[0][0, 0] < carry[1], body, (x, x[0, 0]))[0]

    f = _sharded(fn, mesh)
    with pytest.raises(ValueError, match="known_trip_count.*default_trip_count"):
        _collective_bytes(f, x)
    assert _collective_bytes(f, x, default_trip_count=3) == _only(
        "collective-permute", 3 * LOCAL_BYTES)


def test_unknown_trip_count_without_collectives_is_counted(mesh):
    """A data-dependent loop of local work (e.g. the Pallas interpreter's) sends nothing."""
    def fn(x):
        def body(carry):
            c, n = carry
            return c * 0.5, n + 1

        y = lax.while_loop(lambda carry: carry[0][0, 0] < carry[1], body, (x, x[0, 0]))[0]
        return lax.ppermute(y, "sp", RING)

    assert _collective_bytes(_sharded(fn, mesh), x) == _only("collective-permute", LOCAL_BYTES)


# GPU-style text: async pairs, an async-wrapped all-to-all, iota replica groups (plain
# and transposed), empty groups (all 8 partitions), operands printed with their shapes.
_GPU_STYLE_HLO = """\
HloModule jit_f, entry_computation_layout={(bf16[8,16]{1,0})->bf16[64,16]{1,0}}, num_partitions=8

%body (param: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %param = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = bf16[8,16]{1,0} get-tuple-element(%param), index=1
  %cp-start = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %cp-done = bf16[8,16]{1,0} collective-permute-done(%cp-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,16]{1,0}) tuple(%next, %cp-done)
}

%cond (param.1: (s32[], bf16[8,16])) -> pred[] {
  %param.1 = (s32[], bf16[8,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%a2a_computation (p0: bf16[8,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  ROOT %a2a = bf16[8,16]{1,0} all-to-all(%p0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (p: bf16[8,16]) -> bf16[64,16] {
  %p = bf16[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,16]{1,0}) tuple(%zero, %p)
  %loop = (s32[], bf16[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %y = bf16[8,16]{1,0} get-tuple-element(%loop), index=1
  %a2a-start = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}) async-start(bf16[8,16]{1,0} %y), calls=%a2a_computation
  %a2a-done = bf16[8,16]{1,0} async-done(%a2a-start)
  %f = f32[8,16]{1,0} convert(%a2a-done)
  %rs = f32[4,16]{1,0} reduce-scatter(f32[8,16]{1,0} %f), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %ar-start = f32[4,16]{1,0} all-reduce-start(%rs), channel_id=6, replica_groups={}, to_apply=%add
  %ar-done = f32[4,16]{1,0} all-reduce-done(%ar-start)
  %ag-start = (bf16[8,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%a2a-done), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %ag-done = bf16[64,16]{1,0} all-gather-done(%ag-start)
}
"""


def test_gpu_style_async_and_iota_groups():
    bf16_local = 8 * 16 * 2
    assert hlo.collective_bytes(_GPU_STYLE_HLO) == {
        "all-to-all": bf16_local * 3 / 4,  # iota [2,4]<=[8]: groups of 4
        "all-gather": 7 * bf16_local,  # counted once, at the -start
        "reduce-scatter": 512 * 1 / 2,  # [4,2]<=[2,4]T(1,0): groups of 2, f32 input
        "all-reduce": 2 * 256 * 7 / 8,  # replica_groups={}: all 8 partitions
        "collective-permute": 6 * bf16_local,  # in a while loop of 6 trips
    }


def test_unsupported_collective_is_an_error():
    text = _GPU_STYLE_HLO.replace("all-to-all(%p0)", "ragged-all-to-all(%p0)")
    with pytest.raises(ValueError, match="ragged-all-to-all"):
        hlo.collective_bytes(text)


def test_stablehlo_is_rejected(mesh):
    stablehlo = jax.jit(_sharded(lambda x: lax.psum(x, "sp"), mesh)).lower(x).as_text()
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.collective_bytes(stablehlo)


def test_accepts_lowered(mesh):
    lowered = jax.jit(_sharded(lambda x: lax.psum(x, "sp"), mesh)).lower(x)
    assert hlo.collective_bytes(lowered)["all-reduce"] == 2 * LOCAL_BYTES * 7 / 8


@pytest.mark.parametrize("shape, expected", [
    ("(f32[8,2]{1,0}, bf16[4]{0}, s32[])", 76),
    ("pred[3]{0}", 3),
    ("s4[4]{0}", 2),
    ("f8e4m3fn[10]{0}", 10),
    ("f32[8,128]{1,0:T(8,128)}", 4096),
    ("f32[<=8,4]{1,0}", 128),
    ("token[]", 0),
])
def test_shape_bytes(shape, expected):
    assert hlo.shape_bytes(shape) == expected


def test_memory_bytes(mesh):
    compiled = jax.jit(_sharded(lambda x: lax.all_gather(x, "sp", tiled=True), mesh)).lower(
        x).compile()
    memory = hlo.memory_bytes(compiled)
    assert {"temp", "argument", "output", "alias", "generated_code"} <= set(memory)
    assert memory["argument"] == LOCAL_BYTES  # per device, not the global array
    assert memory["output"] == 8 * LOCAL_BYTES


def test_measure(mesh):
    cost = hlo.measure(_sharded(lambda x: lax.psum(x, "sp"), mesh), x)
    assert cost.collective_bytes == _only("all-reduce", 2 * LOCAL_BYTES * 7 / 8)
    assert cost.total_collective_bytes == 2 * LOCAL_BYTES * 7 / 8
    assert cost.memory["argument"] == LOCAL_BYTES
    assert cost.temp_bytes == cost.memory["temp"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.memory = {}
