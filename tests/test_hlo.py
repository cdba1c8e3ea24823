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

from jax_seqpar.tools import hlo, schedule

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


# TPU-style scheduled text (hand-written after what XLA:TPU prints): an all-gather as an
# async collective fusion (start fusion, a compute fusion that carries the transfer on
# while the Mosaic kernel runs, done fusion: all three bodies hold a copy of the
# collective), a synchronous all-to-all, a ring loop whose K/V hop encloses the kernel
# and whose second hop encloses only a merge, all-reduce pairs around the XLA kernel's
# loop over tiles (it holds a dot) and around a loop without one, and an all-reduce
# fused into a fusion (synchronous).
_TPU_STYLE_HLO = """\
HloModule jit_f, is_scheduled=true, entry_computation_layout={(bf16[8,16]{1,0}, f32[8,16]{1,0})->f32[8,16]{1,0}}, num_partitions=8

%fused_start (s0: bf16[8,16]) -> (bf16[8,16], bf16[64,16], u32[]) {
  %s0 = bf16[8,16]{1,0} parameter(0)
  %ag.0 = bf16[64,16]{1,0} all-gather(%s0), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %acs = (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[]) custom-call(%s0, %ag.0), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.1 (c0: (bf16[8,16], bf16[64,16], u32[]), c1: f32[8,16]) -> (f32[8,16], (bf16[8,16], bf16[64,16], u32[])) {
  %c0 = (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[]) parameter(0)
  %c1 = f32[8,16]{1,0} parameter(1)
  %c2 = bf16[8,16]{1,0} get-tuple-element(%c0), index=0
  %ag.1 = bf16[64,16]{1,0} all-gather(%c2), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %kernel.0 = f32[8,16]{1,0} custom-call(%c1), custom_call_target="tpu_custom_call", backend_config={"kernel_name": "seqpar_mosaic_forward"}
  ROOT %ct = (f32[8,16]{1,0}, (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[])) tuple(%kernel.0, %c0)
}

%fused_done (d0: (bf16[8,16], bf16[64,16], u32[])) -> bf16[64,16] {
  %d0 = (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[]) parameter(0)
  %d1 = bf16[8,16]{1,0} get-tuple-element(%d0), index=0
  %ag.2 = bf16[64,16]{1,0} all-gather(%d1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %acd = bf16[64,16]{1,0} custom-call(%d0, %ag.2), custom_call_target="AsyncCollectiveDone"
}

%mosaic_call (m0: f32[8,16]) -> f32[8,16] {
  %m0 = f32[8,16]{1,0} parameter(0)
  ROOT %kernel.1 = f32[8,16]{1,0} custom-call(%m0), custom_call_target="tpu_custom_call", backend_config={"kernel_name": "seqpar_mosaic_forward"}
}

%merge (g0: f32[8,16], g1: f32[8,16]) -> f32[8,16] {
  %g0 = f32[8,16]{1,0} parameter(0)
  %g1 = f32[8,16]{1,0} parameter(1)
  ROOT %g2 = f32[8,16]{1,0} add(%g0, %g1)
}

%ring_body (r0: (s32[], f32[8,16], bf16[8,16])) -> (s32[], f32[8,16], bf16[8,16]) {
  %r0 = (s32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%r0), index=0
  %acc = f32[8,16]{1,0} get-tuple-element(%r0), index=1
  %kv = bf16[8,16]{1,0} get-tuple-element(%r0), index=2
  %hop = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) collective-permute-start(%kv), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %step = f32[8,16]{1,0} fusion(%acc), kind=kCustom, calls=%mosaic_call
  %hop-done = bf16[8,16]{1,0} collective-permute-done(%hop)
  %back = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%step), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,4},{4,5},{5,6},{6,7},{7,0}}
  %merged = f32[8,16]{1,0} fusion(%step, %acc), kind=kLoop, calls=%merge
  %back-done = f32[8,16]{1,0} collective-permute-done(%back)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %rt = (s32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%next, %back-done, %hop-done)
}

%ring_cond (rc: (s32[], f32[8,16], bf16[8,16])) -> pred[] {
  %rc = (s32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) parameter(0)
  %rci = s32[] get-tuple-element(%rc), index=0
  %seven = s32[] constant(7)
  ROOT %rlt = pred[] compare(%rci, %seven), direction=LT
}

%tiles_body (t0: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %t0 = (s32[], f32[8,16]{1,0}) parameter(0)
  %ti = s32[] get-tuple-element(%t0), index=0
  %tx = f32[8,16]{1,0} get-tuple-element(%t0), index=1
  %tdot = f32[8,8]{1,0} dot(%tx, %tx), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %tt = (s32[], f32[8,16]{1,0}) tuple(%ti, %tx)
}

%count_body (n0: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %n0 = (s32[], f32[8,16]{1,0}) parameter(0)
  %ni = s32[] get-tuple-element(%n0), index=0
  %nx = f32[8,16]{1,0} get-tuple-element(%n0), index=1
  %nn = f32[8,16]{1,0} add(%nx, %nx)
  ROOT %nt = (s32[], f32[8,16]{1,0}) tuple(%ni, %nn)
}

%loop_cond (lc: (s32[], f32[8,16])) -> pred[] {
  %lc = (s32[], f32[8,16]{1,0}) parameter(0)
  %lci = s32[] get-tuple-element(%lc), index=0
  %four = s32[] constant(4)
  ROOT %llt = pred[] compare(%lci, %four), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_all_reduce (f0: f32[8,16]) -> f32[8,16] {
  %f0 = f32[8,16]{1,0} parameter(0)
  %far = f32[8,16]{1,0} all-reduce(%f0), channel_id=8, replica_groups={}, to_apply=%add
  ROOT %fneg = f32[8,16]{1,0} negate(%far)
}

ENTRY %main (p: bf16[8,16], q: f32[8,16]) -> f32[8,16] {
  %p = bf16[8,16]{1,0} parameter(0)
  %q = f32[8,16]{1,0} parameter(1)
  %async-collective-start = (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[]) fusion(%p), kind=kCustom, calls=%fused_start
  %seqpar_mosaic_forward = (f32[8,16]{1,0}, (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[])) fusion(%async-collective-start, %q), kind=kCustom, calls=%async_collective_fusion.1
  %carried = (bf16[8,16]{1,0}, bf16[64,16]{1,0}, u32[]) get-tuple-element(%seqpar_mosaic_forward), index=1
  %async-collective-done = bf16[64,16]{1,0} fusion(%carried), kind=kCustom, calls=%fused_done
  %a2a = bf16[8,16]{1,0} all-to-all(%p), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) tuple(%zero, %q, %a2a)
  %ring = (s32[], f32[8,16]{1,0}, bf16[8,16]{1,0}) while(%init), condition=%ring_cond, body=%ring_body, backend_config={"known_trip_count":{"n":"7"}}
  %ar-start = f32[8,16]{1,0} all-reduce-start(%q), channel_id=5, replica_groups={}, to_apply=%add
  %init.1 = (s32[], f32[8,16]{1,0}) tuple(%zero, %q)
  %tiles = (s32[], f32[8,16]{1,0}) while(%init.1), condition=%loop_cond, body=%tiles_body, backend_config={"known_trip_count":{"n":"4"}}
  %ar-done = f32[8,16]{1,0} all-reduce-done(%ar-start)
  %ar-start.1 = f32[8,16]{1,0} all-reduce-start(%ar-done), channel_id=6, replica_groups={}, to_apply=%add
  %count = (s32[], f32[8,16]{1,0}) while(%init.1), condition=%loop_cond, body=%count_body, backend_config={"known_trip_count":{"n":"4"}}
  %ar-done.1 = f32[8,16]{1,0} all-reduce-done(%ar-start.1)
  ROOT %fused = f32[8,16]{1,0} fusion(%ar-done.1), kind=kLoop, calls=%fused_all_reduce
}
"""

BF16_LOCAL, F32_LOCAL = 8 * 16 * 2, 8 * 16 * 4
_TPU_STYLE_ROWS = [  # (name, kind, runs, bytes per run, is_async, encloses a kernel)
    ("async-collective-start", "all-gather", 1, 7 * BF16_LOCAL, True, True),
    ("a2a", "all-to-all", 1, BF16_LOCAL * 7 / 8, False, False),
    ("ar-start", "all-reduce", 1, 2 * F32_LOCAL * 7 / 8, True, True),  # the tiles' loop
    ("ar-start.1", "all-reduce", 1, 2 * F32_LOCAL * 7 / 8, True, False),  # no matmul inside
    ("hop", "collective-permute", 7, BF16_LOCAL, True, True),
    ("back", "collective-permute", 7, F32_LOCAL, True, False),  # only the merge inside
    ("far", "all-reduce", 1, 2 * F32_LOCAL * 7 / 8, False, False),  # in a fusion
]


def test_collective_schedule_tpu_style():
    rows = schedule.collective_schedule(_TPU_STYLE_HLO)
    assert sorted((r.name, r.kind, r.runs, r.bytes, r.is_async, r.encloses_kernel)
                  for r in rows) == sorted(_TPU_STYLE_ROWS)
    by_name = {r.name: r for r in rows}
    assert by_name["async-collective-start"].enclosed == ("fusion",)  # the carrying fusion
    assert by_name["hop"].enclosed == ("fusion",) and by_name["hop"].computation == "ring_body"
    assert by_name["ar-start"].enclosed == ("while",)


def test_async_collective_fusion_counts_once():
    """The start, carrying and done fusions each hold a copy of the all-gather: one is
    counted, and the schedule's rows sum to collective_bytes."""
    sent = hlo.collective_bytes(_TPU_STYLE_HLO)
    assert sent["all-gather"] == 7 * BF16_LOCAL
    assert sent["collective-permute"] == 7 * (BF16_LOCAL + F32_LOCAL)
    rows = schedule.collective_schedule(_TPU_STYLE_HLO)
    assert sum(r.total_bytes for r in rows) == sum(sent.values())


def test_bytes_hidden():
    hidden = 7 * BF16_LOCAL + 7 * BF16_LOCAL + 2 * F32_LOCAL * 7 / 8
    total = sum(runs * size for _, _, runs, size, _, _ in _TPU_STYLE_ROWS)
    assert schedule.bytes_hidden(_TPU_STYLE_HLO) == dict(hidden=hidden, total=total,
                                                    fraction=hidden / total)
    # GPU-style: async pairs, none around a kernel; every collective is a row.
    gpu = schedule.bytes_hidden(_GPU_STYLE_HLO)
    assert gpu["hidden"] == 0 and gpu["total"] == sum(hlo.collective_bytes(
        _GPU_STYLE_HLO).values())
    assert {r.name: r.is_async for r in schedule.collective_schedule(_GPU_STYLE_HLO)} == {
        "cp-start": True, "a2a-start": True, "rs": False, "ar-start": True, "ag-start": True}


def test_bytes_hidden_follows_the_pipelined_hop_into_the_next_trip():
    """A start whose done is at the head of the loop body (XLA's collective pipeliner)
    encloses what follows it in the body."""
    text = _TPU_STYLE_HLO.replace(
        "  %hop = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) collective-permute-start",
        "  %hop-done = bf16[8,16]{1,0} collective-permute-done(%prev)\n"
        "  %hop = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) collective-permute-start"
    ).replace("  %hop-done = bf16[8,16]{1,0} collective-permute-done(%hop)\n", "").replace(
        "%kv = bf16[8,16]{1,0} get-tuple-element(%r0), index=2",
        "%kv = bf16[8,16]{1,0} get-tuple-element(%r0), index=2\n"
        "  %prev = (bf16[8,16]{1,0}, bf16[8,16]{1,0}, u32[], u32[]) get-tuple-element(%r0), index=2")
    hop, = [r for r in schedule.collective_schedule(text) if r.name == "hop"]
    assert hop.is_async and hop.encloses_kernel and hop.enclosed == ("fusion", "fusion")


def test_collective_schedule_of_a_cpu_program(mesh):
    """On CPU every collective is synchronous: nothing is hidden."""
    compiled = jax.jit(_sharded(lambda x: lax.ppermute(lax.psum(x, "sp"), "sp", RING),
                                mesh)).lower(x).compile()
    rows = schedule.collective_schedule(compiled)
    assert sorted(r.kind for r in rows) == ["all-reduce", "collective-permute"]
    assert not any(r.is_async for r in rows)
    assert schedule.bytes_hidden(compiled) == dict(hidden=0, total=LOCAL_BYTES * (1 + 2 * 7 / 8),
                                              fraction=0.0)


def test_bytes_by_link_splits_a_two_level_mesh(mesh2x4):
    """On a (2, 4) mesh read as 2 hosts of 4: a permute over the outer axis crosses hosts,
    an all-gather over the inner axis stays inside; the device groups are the mesh's."""
    def fn(x):
        hop = lax.ppermute(x, "outer", [(0, 1), (1, 0)])
        return hop + lax.all_gather(x, "inner", tiled=True)[: x.shape[0]]

    compiled = jax.jit(_sharded(fn, mesh2x4)).lower(x).compile()
    rows = {r.kind: r for r in schedule.collective_schedule(compiled)}
    assert {frozenset(pair) for pair in rows["collective-permute"].groups} == {
        frozenset((i, i + 4)) for i in range(4)}
    assert sorted(map(sorted, rows["all-gather"].groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    links = schedule.bytes_by_link(compiled, 4)
    assert links["across"]["total"] == LOCAL_BYTES
    assert links["within"]["total"] == LOCAL_BYTES * 3  # (P-1) x its 512-byte input
    assert links["across"]["fraction"] == links["within"]["fraction"] == 0.0  # CPU: sync
    assert schedule.bytes_by_link(compiled, 8)["across"]["total"] == 0  # one host of 8


@pytest.mark.parametrize("attributes, expected", [
    ("replica_groups={{0,2},{1,3}}", ((0, 2), (1, 3))),
    ("replica_groups=[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("replica_groups={}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("source_target_pairs={{0,1},{1,0}}", ((0, 1), (1, 0))),
])
def test_device_groups_reads_every_form(attributes, expected):
    inst = hlo.Instruction("c", "f32[8]", "all-gather", ("p",), f"channel_id=1, {attributes}")
    assert hlo.device_groups(inst, 8) == expected


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
