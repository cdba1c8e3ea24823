"""jax_seqpar.planning.plan: the traffic model on hand-computed cases and the seed notes, the
layer's one record (LayerShape), the planner's choices, its errors, and the model against the
compiled HLO.

Seed formulas (shared/seeds/002_*), per global token N, P devices, in elements:
Ulysses ``h*d*(P-1)/P**2`` per tensor, 4 tensors (q, k, v, out); ring
``d_kv*(P-1)/P``. Differences from the seed, checked below:
* our Ulysses and ring also send int32 positions ((P-1)/P * 4 bytes per token);
* the seed's Ulysses table gives 1,792 at P=16 and 428 at P=64, which do not follow its
  own formula (1,920 and 504 do);
* the seed's "Ring (MHA KV) N x 128*2*7/8 = N x 224" leaves out the 64 heads (14,336);
* the seed's MLA ring sends the shared 576-dim latent once; our API takes k [.., 576]
  and v [.., 512] as two arrays, so both travel (1,088 per token);
* the seed's MLA Ulysses (N x 57,848, "115x") moves Q with one 1/P, not (P-1)/P**2; with
  this package's Ulysses (K/V heads replicated to P) MLA moves 7.9x the ring (fwd+bwd).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_seqpar
from jax_seqpar.tools import hlo
from jax_seqpar import comm_bytes
from jax_seqpar.core.shape import LayerShape, dtype_of_size
from jax_seqpar.planning.plan import Plan, plan, plan_layer

N = 1024  # tokens; divisible by every P used here
MHA = dict(num_heads=64, num_kv_heads=64, head_dim=128)  # the seed's h=64, d=128
MLA = dict(num_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512)


def _positions_per_token(p):
    return 4 * (p - 1) / p


@pytest.mark.parametrize("p, seed_elements", [(4, 6144), (8, 3584), (16, 1920), (64, 504)])
def test_ulysses_matches_seed_formula(p, seed_elements):
    sent = comm_bytes("ulysses", batch=1, seq_len=N, axis_sizes=p, dtype_bytes=1, **MHA)
    assert sent / N == seed_elements + _positions_per_token(p)
    assert seed_elements == 4 * 64 * 128 * (p - 1) / p**2


def test_ring_seed_cases():
    ring_mha = comm_bytes("ring", batch=1, seq_len=N, axis_sizes=8, dtype_bytes=1, **MHA)
    assert ring_mha / N == 64 * 128 * 2 * 7 / 8 + _positions_per_token(8)  # seed: 224
    ring_mla = comm_bytes("ring", batch=1, seq_len=N, axis_sizes=8, dtype_bytes=1, **MLA)
    assert ring_mla / N == (576 + 512) * 7 / 8 + _positions_per_token(8)  # seed: 576 * 7/8


@pytest.mark.parametrize("heads, kv_heads, p, kv_heads_sent", [
    pytest.param(32, 8, 16, 16, id="gqa_8_on_16"),
    pytest.param(32, 8, 8, 8, id="gqa_8_on_8"),
    pytest.param(32, 16, 8, 16, id="gqa_16_on_8"),
    pytest.param(12, 6, 4, 12, id="gqa_6_on_4"),
    pytest.param(8, 1, 8, 8, id="mqa_on_8"),
])
def test_ulysses_replicates_kv_heads(heads, kv_heads, p, kv_heads_sent):
    assert kv_heads_sent == kv_heads * p // math.gcd(kv_heads, p)
    sent = comm_bytes("ulysses", batch=2, seq_len=N, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=16, v_head_dim=8, axis_sizes=p, dtype_bytes=2)
    local_tokens = 2 * N // p
    per_token = heads * 16 + kv_heads_sent * 16 + kv_heads_sent * 8 + heads * 8
    assert sent == local_tokens * per_token * 2 * (p - 1) / p + (p - 1) * local_tokens * 4


# B=2, S=256, H=8, Hkv=2, Dqk=16, Dv=8, float32, P=8: 64 local tokens, local K+V
# f32[2, 32, 2, 16+8] = 12,288 bytes, positions s32[2, 32] = 256 bytes. These are the
# bytes read from the compiled ring and Ulysses of this package (see the HLO test below).
SMALL = dict(batch=2, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=16, v_head_dim=8,
             dtype_bytes=4)


@pytest.mark.parametrize("strategy, backward, segments, expected", [
    ("ring", False, False, 7 * (12288 + 256)),
    ("ring", False, True, 7 * (12288 + 512)),
    ("ring", True, False, 2 * 7 * (12288 + 256) + 8 * 12288),  # + P fp32 dK/dV hops
    ("ring", True, True, 2 * 7 * (12288 + 512) + 8 * 12288),
    # q [2,32,8,16] + k, v replicated to 8 heads [2,32,8,16|8] + out [2,32,8,8], f32.
    ("ulysses", False, False, 2 * 32 * 8 * 48 * 4 * 7 / 8 + 7 * 256),
    # backward: + the float32 <dout, out> rows f32[2, 32, 8], in one all-to-all.
    ("ulysses", True, False, 2 * 2 * 32 * 8 * 48 * 4 * 7 / 8 + 2048 * 7 / 8 + 7 * 256),
    ("ulysses", True, True, 2 * 2 * 32 * 8 * 48 * 4 * 7 / 8 + 2048 * 7 / 8 + 2 * 7 * 256),
    # all_gather K/V f32[2, 256, 2, 24] and positions s32[2, 256]; backward: the dK/dV
    # accumulators f32[2, 32, 2, 24] passed P hops around the ring.
    ("allgather", False, False, 7 / 8 * (98304 + 2048)),
    ("allgather", True, False, 7 / 8 * (98304 + 2048) + 8 * 12288),
    ("allgather", True, True, 7 / 8 * (98304 + 4096) + 8 * 12288),
])
def test_comm_bytes_hand_computed(strategy, backward, segments, expected):
    assert comm_bytes(strategy, axis_sizes=8, backward=backward, with_segment_ids=segments,
                      **SMALL) == expected


@pytest.mark.parametrize("window", [None, (40, 0)])
def test_allgather_bf16_sends_float32_gradients(window):
    # SMALL in bf16: the gathered K/V [2, 256, 2, 24] travel in bf16 (7/8 of 49,152
    # bytes), the dK/dV accumulators f32[2, 32, 2, 24] (12,288 bytes) P - 1 hops in
    # float32 all the same (float32 sums keep the gradients' error flat in P), the last
    # one (home, the sums done) in bf16. With a causal window of 40 (a halo of 40
    # tokens): 40 tokens of bf16 K/V forward and of float32 dK/dV back.
    shape = dict(SMALL, dtype_bytes=2)
    sent = comm_bytes("allgather", axis_sizes=8, backward=True, window=window, causal=True,
                      **shape)
    if window is None:
        assert sent == 7 / 8 * (49152 + 2048) + 7 * 12288 + 6144
    else:
        assert sent == 2 * 40 * 2 * 24 * (2 + 4)


def test_hybrid_hand_computed():
    # B=1, S=1024, H=8, Hkv=2, D=Dv=16, bf16, (outer, inner) = (2, 4).
    # Ulysses over 4 on S/2: 128 local tokens, K/V replicated 2 -> 4 heads;
    # ring over 2 on [1, 512, 1, 16] K/V (4 heads / 4 devices) with s32 positions.
    shape = dict(batch=1, seq_len=1024, num_heads=8, num_kv_heads=2, head_dim=16,
                 dtype_bytes=2)
    a2a = 128 * (8 * 16 + 4 * 16 + 4 * 16 + 8 * 16) * 2 * 3 / 4
    gather_positions = 3 * 128 * 4
    rotation = 1 * (512 * 1 * 32 * 2 + 512 * 4)
    accumulators = 512 * 1 * 32 * (4 + 2)  # float32 on the ring's hop, bf16 home
    assert comm_bytes("hybrid", axis_sizes=(2, 4), **shape) == a2a + gather_positions + rotation
    # Backward: dout in, dq out in bf16; the replicated K/V's dK/dV out in float32; the
    # float32 <dout, out> rows in (the exchange is cut: 3 pieces at 128 tokens over 4).
    grads_a2a = 128 * (8 * 16 + 8 * 16) * 2 * 3 / 4 + 128 * (4 * 16 + 4 * 16) * 4 * 3 / 4
    rows = 128 * 8 * 4 * 3 / 4
    assert comm_bytes("hybrid", axis_sizes=(2, 4), backward=True, **shape) == (
        a2a + grads_a2a + rows + gather_positions + 2 * rotation + accumulators)


@pytest.mark.parametrize("backward", [False, True])
def test_hybrid_degenerates(backward):
    shape = dict(SMALL, backward=backward)
    # Over (1, 8) the hybrid is Ulysses, cut into pieces as Ulysses is (its <dout, out> rows sent)
    assert comm_bytes("hybrid", axis_sizes=(1, 8), **shape) == comm_bytes(
        "ulysses", axis_sizes=8, **shape)
    assert comm_bytes("hybrid", axis_sizes=(8, 1), **shape) == comm_bytes(
        "ring", axis_sizes=8, **shape)
    assert comm_bytes("ring", axis_sizes=(2, 4), **shape) == comm_bytes(
        "ring", axis_sizes=8, **shape)


@pytest.mark.parametrize("strategy", ["ulysses", "ring", "allgather"])
def test_one_device_sends_nothing(strategy):
    assert comm_bytes(strategy, axis_sizes=1, backward=True, **SMALL) == 0.0


def test_crossover_near_4hd_over_dkv():
    """Seed: MHA Ulysses (h=64, d=128) vs an MLA ring of d_kv=576 cross at P = 4hd/d_kv ~ 57."""
    latent = dict(num_heads=64, num_kv_heads=1, head_dim=288, v_head_dim=288)  # 576 per token
    crossover = 4 * 64 * 128 / 576
    for p in (2, 4, 8, 16, 32, 64):
        ulysses = comm_bytes("ulysses", batch=1, seq_len=N * 64, axis_sizes=p, **MHA)
        ring = comm_bytes("ring", batch=1, seq_len=N * 64, axis_sizes=p, **latent)
        assert (ulysses > ring) == (p < crossover), p


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="tree"), "strategy='tree' is not one of"),
    (dict(num_heads=12), "num_heads=12 is not divisible by the ulysses axis size 8; use "
                         "strategy='ring' or 'hybrid'"),
    (dict(seq_len=1001), "seq_len=1001 is not divisible by the 8 devices.*multiple of 8"),
    (dict(num_kv_heads=3), "num_heads=8 must be a multiple of num_kv_heads=3"),
    (dict(head_dim=0), "head_dim must be a positive int. Got head_dim=0"),
    (dict(dtype_bytes=0), "dtype_bytes must be a positive number"),
    (dict(axis_sizes=(2, 0)), "axis_sizes must be a positive int"),
    (dict(strategy="hybrid"), r"hybrid needs axis_sizes=\(outer, inner\). Got \(8,\)"),
    (dict(strategy="hybrid", axis_sizes=(1, 8), num_heads=4, num_kv_heads=4),
     "num_heads=4 is not divisible by the ulysses \\(inner\\) axis size 8"),
])
def test_comm_bytes_errors(kwargs, message):
    args = dict(SMALL, strategy="ulysses", axis_sizes=8)
    args.update(kwargs)
    strategy = args.pop("strategy")
    with pytest.raises(ValueError, match=message):
        comm_bytes(strategy, **args)


@pytest.mark.parametrize("args, kwargs, strategy, reason", [
    pytest.param((32768, 32, 32, 128, 8), {}, "ulysses",
                 "ulysses: 32 heads divisible by 8 and a2a traffic 0.12x of ring",
                 id="mha_32_heads_on_8"),
    # The seed's tree says ring when num_kv_heads < P; replicating K/V heads makes
    # Ulysses feasible and it still sends fewer bytes.
    pytest.param((32768, 32, 8, 128, 16), {}, "ulysses",
                 "ulysses: 32 heads divisible by 16 (8 KV heads replicated to 16) and a2a "
                 "traffic 0.22x of ring", id="gqa_8_kv_heads_on_16"),
    pytest.param((32768, 128, 1, 576, {"sp": 8}), dict(v_head_dim=512), "ring",
                 "ring: only 1 KV head (MQA/MLA) and ulysses would move 8.4x more bytes",
                 id="mla_on_8"),
    pytest.param((32768, 12, 12, 64, 8), dict(causal=True), "ring",
                 "ring: num_heads=12 is not divisible by the axis size 8, so ulysses cannot "
                 "split heads; zigzag layout balances causal work", id="12_heads_on_8"),
    pytest.param((32768, 32, 32, 128, {"dcn": 2, "ici": 4}), {}, "hybrid",
                 "hybrid: ulysses over 'ici' (4 divides 32 heads) and ring over 'dcn' send "
                 "0.28x the bytes of a ring over both axes", id="two_axes_hybrid"),
    pytest.param((32768, 12, 12, 128, {"dcn": 2, "ici": 8}), {}, "ring",
                 "ring over ('dcn', 'ici'): num_heads=12 is not divisible by the inner axis "
                 "size 8, so hybrid cannot use ulysses", id="two_axes_ring"),
    pytest.param((4096, 8, 8, 64, 1), {}, "ulysses",
                 "ulysses: 8 heads divisible by 1 and a2a traffic 1.00x of ring (one device: "
                 "nothing is sent)", id="tie_goes_to_ulysses"),
])
def test_plan_choices(args, kwargs, strategy, reason):
    chosen = plan(*args, **kwargs)
    assert isinstance(chosen, Plan)
    assert chosen.strategy == strategy
    assert chosen.reason == reason
    assert chosen.bytes_per_device == chosen.candidates[strategy] == min(
        chosen.candidates.values())
    seq_len, heads, kv_heads, head_dim, axis_sizes = args
    sizes = axis_sizes if isinstance(axis_sizes, int) else tuple(axis_sizes.values())
    sizes = sizes[0] if isinstance(sizes, tuple) and len(sizes) == 1 else sizes
    assert chosen.axis_sizes == sizes
    assert chosen.bytes_per_device == comm_bytes(
        strategy, batch=1, seq_len=seq_len, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=kwargs.get("v_head_dim"), axis_sizes=sizes,
        backward=True)


def test_plan_from_mesh_shape():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dcn", "ici"))
    chosen = plan(4096, 8, 8, 64, mesh.shape)
    assert (chosen.strategy, chosen.seq_axes, chosen.axis_sizes) == (
        "hybrid", ("dcn", "ici"), (2, 4))
    assert plan(4096, 8, 8, 64, 8).seq_axes == "sp"
    assert plan(4096, 8, 8, 64, {"seq": 8}).seq_axes == "seq"


@pytest.mark.parametrize("axis_sizes", ["sp", {}, {"a": 2, "b": 2, "c": 2}, {"sp": 0}])
def test_plan_rejects_bad_mesh_axes(axis_sizes):
    with pytest.raises(ValueError, match="axis_sizes"):
        plan(4096, 8, 8, 64, axis_sizes)


def test_plan_validates_through_comm_bytes():
    with pytest.raises(ValueError, match="seq_len=1001 is not divisible by the 8 devices"):
        plan(1001, 8, 8, 64, 8)
    with pytest.raises(ValueError, match=r"dtype_bytes must be the size of a float dtype, one "
                                         r"of \[1, 2, 4, 8\].*Got dtype_bytes=3"):
        plan(1024, 8, 8, 64, 8, dtype_bytes=3)


# --- the layer's one record ------------------------------------------------------------

def test_layer_shape_fills_in_and_normalizes():
    shape = LayerShape(2, 1024, 8, 2, 64, dtype=jnp.float32, window=16)
    assert (shape.v_head_dim, shape.dtype, shape.dtype_bytes, shape.window) == (
        64, "float32", 4, (16, 16))
    assert shape.operand_shapes() == ((2, 1024, 8, 64), (2, 1024, 2, 64), (2, 1024, 2, 64),
                                      (2, 1024, 8, 64))
    assert LayerShape(1, 8, 1, 1, 576, 512).v_head_dim == 512
    assert [dtype_of_size(n) for n in (1, 2, 4, 8)] == [
        "float8_e4m3fn", "bfloat16", "float32", "float64"]
    assert hash(shape) == hash(LayerShape(2, 1024, 8, 2, 64, dtype="float32", window=(16, 16)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "batch must be a positive int. Got batch=0"),
    (dict(head_dim=2.5), "head_dim must be a positive int. Got head_dim=2.5"),
    (dict(v_head_dim=True), "v_head_dim must be a positive int. Got v_head_dim=True"),
    (dict(num_kv_heads=3), "num_heads=8 must be a multiple of num_kv_heads=3"),
    (dict(dtype="int8"), "dtype='int8' is not a floating-point dtype"),
    (dict(dtype="fp16"), "dtype='fp16' is not a floating-point dtype"),
    (dict(window=(-1, 0)), "window sides must be >= 0"),
    (dict(causal="yes"), "causal must be True or False. Got causal='yes'"),
    (dict(backward=None), "backward must be True or False"),
])
def test_layer_shape_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerShape(**dict(dict(batch=1, seq_len=256, num_heads=8, num_kv_heads=2,
                               head_dim=16), **kwargs))


@pytest.mark.parametrize("strategy, axis_sizes", [
    ("ulysses", 8), ("ring", 8), ("allgather", 4), ("hybrid", (2, 4))])
@pytest.mark.parametrize("extra", [
    dict(), dict(backward=False), dict(segment_ids=True), dict(causal=True, window=(32, 32))])
def test_comm_bytes_of_a_layer_shape_is_its_keywords(strategy, axis_sizes, extra):
    shape = LayerShape(2, 256, 8, 2, 16, 8, dtype="float32", **extra)
    keywords = dict(batch=2, seq_len=256, num_heads=8, num_kv_heads=2, head_dim=16,
                    v_head_dim=8, dtype_bytes=4, backward=extra.get("backward", True),
                    with_segment_ids=extra.get("segment_ids", False),
                    window=extra.get("window"), causal=extra.get("causal", False))
    assert comm_bytes(strategy, axis_sizes=axis_sizes, **shape.comm_kwargs()) == comm_bytes(
        strategy, axis_sizes=axis_sizes, **keywords)


@pytest.mark.parametrize("hardware", [None, "h100"])
def test_plan_is_plan_layer_of_its_keywords(hardware):
    args, kwargs = (32768, 12, 4, 128, {"dcn": 2, "ici": 4}), dict(v_head_dim=64,
                                                                   dtype_bytes=4, causal=True)
    shape = LayerShape(1, 32768, 12, 4, 128, 64, dtype="float32", causal=True)
    assert plan(*args, hardware=hardware, **kwargs) == plan_layer(shape, args[-1],
                                                                  hardware=hardware)


# --- the model against the compiled program (traffic) ------------------------------------

def _compiled_bytes(per_shard, mesh, backward, with_segment_ids):
    """Bytes one device sends in the compiled per-shard attention (fwd, or fwd + vjp)."""
    q = jnp.ones((2, 256, 8, 16), jnp.float32)  # SMALL, f32: XLA:CPU promotes bf16 anyway
    k = jnp.ones((2, 256, 2, 16), jnp.float32)
    v = jnp.ones((2, 256, 2, 8), jnp.float32)
    segment_ids = jnp.zeros((2, 256), jnp.int32)
    seq = P(None, tuple(mesh.axis_names))

    def attend(q, k, v, segment_ids):
        return per_shard(q, k, v, causal=True,
                         segment_ids=segment_ids if with_segment_ids else None)

    f = jax.shard_map(attend, mesh=mesh, in_specs=(seq,) * 4, out_specs=seq)
    if backward:  # a vjp with a given cotangent: no loss reduction in the program
        def f_and_vjp(q, k, v, segment_ids, cotangent):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, segment_ids), q, k, v)
            return out, vjp(cotangent)

        args = (q, k, v, segment_ids, jnp.ones((2, 256, 8, 8), jnp.float32))
        return hlo.collective_bytes(jax.jit(f_and_vjp).lower(*args).compile())
    return hlo.collective_bytes(jax.jit(f).lower(q, k, v, segment_ids).compile())


def _per_shard(strategy):
    fn = getattr(jax_seqpar, f"{strategy}_attention")
    if strategy == "hybrid":
        return functools.partial(fn, seq_axes=("outer", "inner"))
    return functools.partial(fn, seq_axes="sp")


@pytest.mark.parametrize("with_segment_ids", [False, True], ids=["plain", "segments"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("strategy", ["ulysses", "ring", "allgather", "hybrid"])
def test_comm_bytes_matches_compiled_hlo(strategy, backward, with_segment_ids):
    devices = np.array(jax.devices())
    if strategy == "hybrid":
        # A ring of 4, not 2: with one hop XLA merges the backward's K/V hop with the
        # forward's (CSE across the unrolled one-trip loops) and sends less than modelled.
        mesh, axis_sizes = Mesh(devices.reshape(4, 2), ("outer", "inner")), (4, 2)
    else:
        mesh, axis_sizes = Mesh(devices, ("sp",)), 8
    measured = _compiled_bytes(_per_shard(strategy), mesh, backward, with_segment_ids)
    predicted = comm_bytes(strategy, axis_sizes=axis_sizes, backward=backward,
                           with_segment_ids=with_segment_ids, **SMALL)
    assert sum(measured.values()) == predicted, measured
