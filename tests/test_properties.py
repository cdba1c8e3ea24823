"""Property-based tests: calls drawn across the public argument space, each checked against
the dense reference (outputs and gradients) or for a clear ``ValueError``.

Hypothesis draws a call of :func:`jax_seqpar.sequence_parallel_attention` (every strategy
of the registry and ``"auto"``, the hybrid over two axes or a split one, no mesh,
Explicit meshes inside and outside ``jax.set_mesh``, Auto meshes, inputs unsharded,
replicated, or sharded over the sequence, the batch or the heads, ``batch_axes``,
documents, key padding, positions, windows, softcap, sinks, the lse, tile sizes, and bad
inputs from the contract's list), of :func:`jax_seqpar.dot_product_attention` (against
``jax.nn``: ``T != S``, lengths alone and together, key-padding masks, 3-D inputs) and of
the Flax layers (:class:`jax_seqpar.flax.SelfAttention`, ``nnx.MultiHeadAttention`` with
:func:`jax_seqpar.flax.make_attention_fn`), made outside or inside ``jax.set_mesh`` and
run for a few ``nnx.jit`` evaluation and training steps. A draw the contract
(docs/design.md) refuses must raise a ``ValueError`` naming the argument; a draw it
accepts must match the reference at every step of a jitted loop whose outputs are the
next step's inputs, typed on the caller's mesh (and, on Explicit meshes, compiled once).

Compiling is the cost on CPU, so sizes come from small discrete sets (programs repeat)
and every jitted function is cached by its static configuration. The default tier runs a
small seeded budget (``derandomize``: the same draws every run) and explicit examples of
the paths users met first; the ``matrix`` tier a large budget, shrinking what fails.

Left out on purpose: the Pallas and Mosaic kernels (interpreted on CPU, minutes a call;
tests/test_pallas.py and test_mosaic.py hold them), dense masks and biases (handed to
``jax.nn`` as they are), ``softcap``/``sinks``/a ``Dv != D`` in the drop-in (``jax.nn``
has none of them: the global call draws them), the KV cache (tests/test_inference.py),
``jax_enable_x64`` (a process-wide flag). Bad values (not dtypes) are passed to an eager
call, as given: under the caller's ``jit`` they are tracers, and numpy ``int64`` becomes
``int32`` before any library sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import checks
import contexts
import jax_seqpar
from jax_seqpar.core import reference
from jax_seqpar.kernels import BlockSizes
from jax_seqpar.flax import SelfAttention, make_attention_fn
from jax_seqpar.strategies.registry import STRATEGIES as REGISTRY

#: Examples each property draws (besides its explicit examples): the default tier's
#: (seeded, about a minute on 2 cores for the three) and the matrix tier's (about four
#: minutes of one core for the three).
BUDGETS = {"default": {"spa": 5, "dpa": 5, "flax": 2},
           "large": {"spa": 20, "dpa": 20, "flax": 6}}
SEQS, HEAD_DIMS, HEADS = (1, 7, 16, 30, 64), (8, 16), (1, 2, 4, 8)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
#: mesh name -> (shape, axis names, seq_axes, batch axis or None).
MESHES = {
    "sp8": ((8,), ("sp",), "sp", None),
    "dp2-sp4": ((2, 4), ("dp", "sp"), "sp", "dp"),
    "dcn2-ici4": ((2, 4), ("dcn", "ici"), ("dcn", "ici"), None),
}
#: context -> (axis type, called inside jax.set_mesh); "none": mesh=None.
MESH_KINDS = {"explicit-set-mesh": (AxisType.Explicit, True),
              "explicit": (AxisType.Explicit, False),
              "auto": (AxisType.Auto, False), "none": (None, False)}
WINDOWS = (None, 0, 3, (5, 2), (0, 4), (2, 0), (70, 70), (1, 100))
STEP_SIZE = 0.1


BUDGET_PARAMS = [pytest.param("default", id="default"),
                 pytest.param("large", id="large", marks=pytest.mark.matrix)]


def _settings(budget: str, entry: str):
    """Seeded, no example database in the repository, no deadline (compiling varies);
    the default tier does not shrink (each shrink step compiles: minutes), the large
    one does (a minimal failing call)."""
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if budget == "large" else ())
    return settings(max_examples=BUDGETS[budget][entry], derandomize=True, deadline=None,
                    database=None, phases=phases, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def _mesh(name: str, axis_type):
    shape, names, _, _ = MESHES[name]
    return contexts.make_mesh(shape, names, axis_type)


_JITTED = {}


def _cached(key, build):
    """``jax.jit(build())``, once per static ``key``: equal draws reuse the compiled program."""
    if key not in _JITTED:
        _JITTED[key] = jax.jit(build())
    return _JITTED[key]


# --- what a refused draw raises ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Refusal:
    """A draw the contract refuses (``ValueError`` naming ``argument``, or one of several
    ``|``-separated) or, ``either``, may refuse or honour (then it must equal the
    reference)."""

    argument: str
    either: bool = False


def _refusal(reasons) -> Optional[Refusal]:
    """One :class:`Refusal` of ``[(argument, either)]``: strict if any reason is."""
    if not reasons:
        return None
    return Refusal("|".join(dict.fromkeys(a for a, _ in reasons)),
                   all(either for _, either in reasons))


def _call_result(call, refusal: Optional[Refusal]):
    """``(call(), None)``, or ``(None, error)`` where ``refusal`` allows it; a refused draw
    that does not raise fails, and so does a ``ValueError`` that does not name it."""
    try:
        result = call()
    except ValueError as error:
        if refusal is None:
            raise
        assert any(name in str(error) for name in refusal.argument.split("|")), (
            f"the ValueError should name {refusal.argument!r}: {error}")
        return None, error
    assert refusal is None or refusal.either, (
        f"expected a ValueError naming {refusal.argument!r}, the call returned")
    return result, None


# --- shared pieces ----------------------------------------------------------------------------

def _place(x, mesh, placement: str, seq_entry, batch_axis):
    """``x`` as drawn: left unsharded, replicated on ``mesh`` or sharded along its batch
    (``batch_axis``) and sequence dims where those divide."""
    if x is None or mesh is None or placement == "host" or not hasattr(x, "ndim"):
        return x
    spec = [None] * x.ndim
    if placement == "sharded" and x.ndim >= 2:
        names = (seq_entry,) if isinstance(seq_entry, str) else seq_entry
        if x.shape[1] % math.prod(mesh.shape[n] for n in names) == 0:
            spec[1] = seq_entry
        if batch_axis is not None and x.shape[0] % mesh.shape[batch_axis] == 0:
            spec[0] = batch_axis
    if placement == "heads" and x.ndim == 4 and batch_axis is not None:
        if x.shape[2] % mesh.shape[batch_axis] == 0:  # tensor parallel over the other axis
            spec[2] = batch_axis
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _assert_on_callers_mesh(tree, mesh):
    """Every array ``tree`` returns lives on the caller's mesh (or on no mesh): a mesh a
    strategy builds inside must not escape into the caller's program."""
    if mesh is None:
        return
    for x in jax.tree.leaves(tree):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            assert tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names), (
                f"an output is on the mesh {dict(sharding.mesh.shape)}, not the caller's "
                f"{dict(mesh.shape)}")


def _assert_close(got, want, tolerances, dtype, kind, scale=None):
    """``got`` within ``tolerances(dtype, kind)`` of ``want``; gradients (and anything
    given a ``scale``) relative to ``max(1, scale)`` (default: ``want``'s largest)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    if kind == "grad" and scale is None:
        scale = float(np.abs(want).max(initial=0.0))
    scale = 1.0 if scale is None else max(1.0, scale)
    np.testing.assert_allclose(got / scale, want / scale, **tolerances(dtype, kind),
                               err_msg=kind)


def _placed_like(cotangent, out):
    """``cotangent`` placed as ``out`` is: on an Explicit mesh its type carries the axes."""
    if not isinstance(out, jax.core.Tracer):  # an eager call
        return jax.device_put(cotangent, out.sharding)
    sharding = jax.typeof(out).sharding
    if any(e is not None for e in getattr(sharding, "spec", ())):
        return jax.reshard(cotangent, sharding)
    return cotangent


def _vjp_step(fn, argnums):
    """``(args, cotangents) -> (fn(*args), grads w.r.t. args[argnums], args after one
    gradient step)``: a training step whose outputs are the next step's inputs."""

    def step(args, cotangents):
        def on(*diff):
            full = list(args)
            for i, x in zip(argnums, diff):
                full[i] = x
            return fn(*full)

        out, vjp = jax.vjp(on, *(args[i] for i in argnums))
        grads = vjp(jax.tree.map(_placed_like, cotangents, out))
        new = list(args)
        for i, g in zip(argnums, grads):
            new[i] = (args[i] - STEP_SIZE * g).astype(args[i].dtype)
        return out, grads, tuple(new)

    return step


def _run_steps(step, args, cotangents, steps: int, under):
    """``steps`` calls of ``step``, each fed the previous one's updated arguments; returns
    ``[(args, out, grads)]`` per step (host copies of the arguments, for the reference)."""
    results = []
    for _ in range(steps):
        with under():
            out, grads, new = step(args, cotangents)
        results.append((args, out, grads))
        args = new
    return results


# --- sequence_parallel_attention ---------------------------------------------------------------

@st.composite
def spa_calls(draw):
    """One call of ``sequence_parallel_attention``, as a dict of its static and data parts."""
    kind = draw(st.sampled_from(list(MESH_KINDS)))
    mesh_name = draw(st.sampled_from(list(MESHES)))
    strategy = draw(st.sampled_from(("auto",) + tuple(REGISTRY)))
    heads = draw(st.sampled_from(HEADS))
    kv_heads = draw(st.sampled_from([h for h in HEADS if heads % h == 0]))
    ulysses_size = None
    if strategy == "hybrid" or draw(st.integers(0, 9)) == 0:
        ulysses_size = draw(st.sampled_from((None, 1, 2, 4, 8)))
    documents = draw(st.sampled_from((None, "sorted", "interleaved")))
    case = dict(
        kind=kind, mesh=mesh_name, strategy=strategy, ulysses_size=ulysses_size,
        batch=draw(st.sampled_from((1, 2, 3))), seq=draw(st.sampled_from(SEQS)),
        heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from(HEAD_DIMS)),
        v_head_dim=draw(st.sampled_from((None, 8))),
        dtype=draw(st.sampled_from(DTYPES)), causal=draw(st.booleans()),
        window=draw(st.sampled_from(WINDOWS)), documents=documents,
        key_padding=draw(st.sampled_from((False, False, True))),
        positions=draw(st.sampled_from((None, None, "permuted", "shifted"))),
        layout=draw(st.sampled_from(("auto",) * 4 + ("contiguous", "zigzag", "striped",
                                                      "per_document"))),
        scale=draw(st.sampled_from((None, 0.3))), softcap=draw(st.sampled_from((None, 5.0))),
        sinks=draw(st.sampled_from((None, None, "float32", "like-q"))),
        return_lse=draw(st.booleans()),
        kernel=draw(st.sampled_from(("auto", "xla"))),
        block_sizes=draw(st.sampled_from((None, None, (8, 8), (16, 8), (128, 128)))),
        batch_axes=draw(st.sampled_from((None, None, "dp"))),
        placement=draw(st.sampled_from(("host", "replicated", "sharded", "heads"))),
        jit=draw(st.sampled_from((True, True, False))), steps=draw(st.sampled_from((1, 2, 3))),
        bad=draw(st.sampled_from((None,) * 8 + tuple(BAD_INPUTS))),
        seed=draw(st.integers(0, 2**16)))
    if case["batch_axes"] is not None and case["placement"] == "heads":
        case["placement"] = "sharded"  # one role for the other axis at a time
    if case["bad"] is not None:
        if _spa_refusal({**case, "bad": None}) is not None:
            case["bad"] = None  # one reason to refuse a call at a time
        else:  # the values must reach the call as the user gave them: eager, unplaced
            case.update(placement="host", steps=1)
            if case["bad"] in VALUE_BAD_INPUTS:
                case["jit"] = False
    return case


#: Inputs the contract refuses (or may honour: ``either``), each on top of a valid draw:
#: name -> (the argument a ValueError must name, either).
BAD_INPUTS = {
    "float-segment-ids": ("segment_ids", False),
    "int64-segment-ids-past-int32": ("segment_ids", False),
    "uint32-segment-ids": ("segment_ids", False),
    "float-positions": ("positions", False),
    "positions-near-int32-limit": ("positions", True),
    "softcap-true": ("softcap", False),
    "softcap-inf": ("softcap", True),
    "causal-string": ("causal", False),
    "window-negative": ("window", False),
    "window-float": ("window", False),
    "window-past-int32": ("window", True),
    "window-int32-max": ("window", True),
    "scale-array": ("scale", True),
    "sinks-scalar": ("sinks", True),
    "batch-0": ("batch", True),
    "seq-0": ("seq", True),
}


#: Bad values (not dtypes): visible only to an eager call (under the caller's jit they are
#: tracers, and numpy int64 becomes int32 before the library sees it).
VALUE_BAD_INPUTS = ("int64-segment-ids-past-int32", "uint32-segment-ids",
                    "positions-near-int32-limit")


def _spa_refusal(c) -> Optional[Refusal]:
    """What the contract says of draw ``c``: None (valid) or the refusal it expects (any
    one of the arguments at fault may be named)."""
    if c["bad"] is not None:
        return Refusal(*BAD_INPUTS[c["bad"]])
    reasons = []  # (argument, either)
    if c["block_sizes"] not in (None, (128, 128)) and c["kernel"] == "auto":
        # "auto" may run Triton (powers of two >= 16) or Mosaic (multiples of 128)
        reasons.append(("block", False))
    if c["key_padding"] and c["documents"] is None:  # keys' ids need the queries'
        reasons.append(("kv_segment_ids", False))
    if c["kind"] == "none":
        # Mesh-only arguments are honoured (the result is exact attention) or refused.
        reasons += [(name, True) for name, unused in (
            ("strategy", "auto"), ("ulysses_size", None), ("layout", "auto"), ("batch_axes", None))
            if c[name] != unused]
        return _refusal(reasons)
    _, names, seq_axes, batch_axis = MESHES[c["mesh"]]
    shape = _mesh(c["mesh"], AxisType.Explicit).shape
    axes = (seq_axes,) if isinstance(seq_axes, str) else seq_axes
    devices = math.prod(shape[a] for a in axes)
    if c["batch_axes"] is not None and (c["batch_axes"] not in names or c["batch"] % 2):
        reasons.append(("batch_axes", False))
    if c["layout"] == "per_document" and c["documents"] is None:
        reasons.append(("segment_ids", False))
    if c["positions"] is not None and c["layout"] not in ("auto", "contiguous"):
        reasons.append(("positions", False))
    if c["ulysses_size"] is not None and (c["strategy"] not in ("hybrid", "auto")
                                          or devices % c["ulysses_size"]):
        reasons.append(("ulysses_size", False))  # "auto" too: a size no split allows
    # Heads sharded over the other axis stay there (tensor parallel): each sequence group
    # splits only its share, when q, k and v all shard them and the call can see it (an
    # Explicit type, or a concrete array on an Auto mesh).
    kept = (c["placement"] == "heads" and batch_axis is not None and c["heads"] % 2 == 0
            and c["kv_heads"] % 2 == 0 and (c["kind"] != "auto" or not c["jit"]))
    heads = c["heads"] // 2 if kept else c["heads"]
    if c["strategy"] == "ulysses" and heads % devices:
        reasons.append(("heads", False))
    if c["strategy"] == "hybrid":
        inner = c["ulysses_size"]
        if inner is None and len(axes) != 2:
            reasons.append(("ulysses_size", False))
        elif heads % (inner or shape[axes[1]]):
            reasons.append(("heads", False))
    return _refusal(reasons)


def _spa_inputs(c):
    """``(args, ids, kwargs, ref, ref_ids, ref_sinks)``: the call's arrays ``(q, k, v,
    sinks)``, its token metadata and keywords as drawn (a bad input as the user gives it),
    and the reference's equivalents (``int32`` metadata)."""
    batch, seq = c["batch"], c["seq"]
    if c["bad"] == "batch-0":
        batch = 0
    if c["bad"] == "seq-0":
        seq = 0
    d, dv = c["head_dim"], c["v_head_dim"] or c["head_dim"]
    q, k, v = checks.normals([(batch, seq, c["heads"], d), (batch, seq, c["kv_heads"], d),
                              (batch, seq, c["kv_heads"], dv)], c["dtype"], c["seed"])
    rng = np.random.default_rng(c["seed"] + 1)
    segment_ids = kv_segment_ids = positions = None
    if c["documents"] == "sorted":
        segment_ids = np.sort(rng.integers(0, 3, (batch, seq)), axis=1).astype(np.int32)
    elif c["documents"] == "interleaved":
        segment_ids = rng.integers(-2, 2, (batch, seq)).astype(np.int32)
    if c["key_padding"]:  # padded keys: an id of their own
        kv_segment_ids = np.where(rng.random((batch, seq)) < 0.3, 7,
                                  0 if segment_ids is None else segment_ids).astype(np.int32)
    if c["positions"] == "permuted":
        positions = np.stack([rng.permutation(seq) for _ in range(batch)]).astype(np.int32)
        positions = positions.reshape(batch, seq)
    elif c["positions"] == "shifted":
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32) + 1000, (batch, seq)).copy()
    sinks = None
    if c["sinks"] is not None:
        sinks = jnp.asarray(rng.standard_normal(c["heads"]),
                            jnp.float32 if c["sinks"] == "float32" else c["dtype"])
    kwargs = dict(causal=c["causal"], window=c["window"], scale=c["scale"],
                  softcap=c["softcap"], return_lse=c["return_lse"], kernel=c["kernel"],
                  block_sizes=None if c["block_sizes"] is None else BlockSizes(
                      *c["block_sizes"]))
    ref = dict(causal=c["causal"], window=c["window"], scale=c["scale"], softcap=c["softcap"],
               return_lse=c["return_lse"])
    ref_ids = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, positions=positions)
    bad = c["bad"]
    if bad in ("float-segment-ids", "int64-segment-ids-past-int32", "uint32-segment-ids"):
        cut = np.arange(seq)[None, :] >= seq // 2
        two = np.broadcast_to(cut, (batch, seq))
        segment_ids = {"float-segment-ids": np.where(two, 0.7, 0.3).astype(np.float32),
                       "int64-segment-ids-past-int32": np.where(two, 2**32 + 1, 1),
                       "uint32-segment-ids": np.where(two, 2**31, 0).astype(np.uint32)}[bad]
        kv_segment_ids = None
    elif bad == "float-positions":
        positions = np.broadcast_to(np.arange(seq, dtype=np.float32) * 0.5, (batch, seq)).copy()
    elif bad == "positions-near-int32-limit":
        offset = 2**31 - 1 - seq
        positions = np.broadcast_to(np.arange(seq, dtype=np.int32) + offset, (batch, seq)).copy()
        ref_ids["positions"] = positions - offset  # the mask depends on differences only
        kwargs["window"] = ref["window"] = (4, 4)
    elif bad == "softcap-true":
        kwargs["softcap"] = True
    elif bad == "softcap-inf":
        kwargs["softcap"], ref["softcap"] = float("inf"), None
    elif bad == "causal-string":
        kwargs["causal"] = "no"
    elif bad == "window-negative":
        kwargs["window"] = (-1, 3)
    elif bad == "window-float":
        kwargs["window"] = (-0.5, 3)
    elif bad == "window-past-int32":
        kwargs["window"], ref["window"] = (2**31, 0), (seq + 1, 0)
    elif bad == "window-int32-max":
        kwargs["window"], ref["window"], kwargs["causal"] = 2**31 - 1, seq + 1, True
        ref["causal"] = True
    elif bad == "scale-array":
        kwargs["scale"], ref["scale"] = np.array([0.3]), 0.3
    elif bad == "sinks-scalar":
        sinks = 0.5
        ref_sinks = jnp.full((c["heads"],), 0.5, jnp.float32)
    if bad not in ("positions-near-int32-limit",) and positions is not None:
        ref_ids["positions"] = positions
    if bad in ("float-segment-ids", "int64-segment-ids-past-int32", "uint32-segment-ids"):
        ref_ids.update(segment_ids=None, kv_segment_ids=None)  # never compared: refused
    ids = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, positions=positions)
    ids = {n: x if x is None or bad else jnp.asarray(x) for n, x in ids.items()}
    ref_ids = {n: None if x is None else jnp.asarray(x, jnp.int32) for n, x in ref_ids.items()}
    ref_sinks = ref_sinks if bad == "sinks-scalar" else sinks
    return (q, k, v, sinks), ids, kwargs, ref, ref_ids, ref_sinks


def _spa_static(c, kwargs):
    """The call's static keywords (mesh-only ones passed without a mesh too: they must be
    honoured or refused, never dropped)."""
    static = dict(kwargs, strategy=c["strategy"], ulysses_size=c["ulysses_size"],
                  layout=c["layout"], batch_axes=c["batch_axes"])
    if c["kind"] != "none":
        static["seq_axes"] = MESHES[c["mesh"]][2]
    return static


def _check_spa(c, tolerances):
    args, ids, kwargs, ref, ref_ids, ref_sinks = _spa_inputs(c)
    axis_type, under_mesh = MESH_KINDS[c["kind"]]
    mesh = None if axis_type is None else _mesh(c["mesh"], axis_type)
    static = _spa_static(c, kwargs)
    argnums = (0, 1, 2) + ((3,) if c["sinks"] is not None and c["bad"] != "sinks-scalar"
                           else ())
    _, _, seq_axes, batch_axis = MESHES[c["mesh"]]

    def build():
        def attend(q, k, v, sinks, segment_ids, kv_segment_ids, positions):
            return jax_seqpar.sequence_parallel_attention(
                q, k, v, mesh=mesh, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                positions=positions, sinks=sinks, **static)
        return _vjp_step(attend, argnums)

    key = ("spa", c["kind"], c["mesh"], argnums, repr(sorted(static.items(), key=str)))
    step = _cached(key, build) if c["jit"] else build()
    placed = tuple(_place(x, mesh, c["placement"], seq_axes, batch_axis) for x in args)
    placed += tuple(_place(ids[n], mesh, c["placement"], seq_axes, batch_axis)
                    for n in ("segment_ids", "kv_segment_ids", "positions"))
    shape = args[0].shape[:3] + args[2].shape[3:]
    cotangents = checks.normal(shape, c["dtype"], seed=c["seed"] + 2)
    if c["return_lse"]:
        cotangents = (cotangents, checks.normal(shape[:3], jnp.float32, seed=c["seed"] + 3))
    under = (lambda: jax.set_mesh(mesh)) if under_mesh else contextlib.nullcontext

    compiled = step._cache_size() if c["jit"] else 0
    steps, _ = _call_result(lambda: _run_steps(step, placed, cotangents, c["steps"], under),
                            _spa_refusal(c))
    if steps is None:
        return
    if c["jit"] and axis_type == AxisType.Explicit and c["placement"] != "host":
        # each step's outputs are typed like its inputs: the loop compiles once
        assert step._cache_size() <= compiled + 1, "a repeated step compiled again"
    reference_step = _cached(("spa-reference", repr(sorted(ref.items(), key=str)), argnums),
                             lambda: _vjp_step(functools.partial(_reference_spa, ref=ref),
                                               argnums))
    for args_i, out, grads in steps:
        _assert_on_callers_mesh((out, grads), mesh)
        host = [None if x is None else jnp.asarray(np.asarray(x)) for x in args_i[:4]]
        host[3] = ref_sinks if c["bad"] == "sinks-scalar" else host[3]
        want_out, want_grads, _ = reference_step(
            (*checks.upcast(tuple(host)), ref_ids["segment_ids"], ref_ids["kv_segment_ids"],
             ref_ids["positions"]), jax.tree.map(lambda x: x.astype(jnp.float32), cotangents))
        outs = out if c["return_lse"] else (out,)
        assert outs[0].shape == shape, (outs[0].shape, shape)
        # the one comparison with the reference (out, lse, gradients), as every exactness
        # case makes it (tests/exactness.py)
        checks.assert_close(out, grads, want_out, want_grads, tolerances, args=args_i,
                            argnums=argnums)
        if axis_type == AxisType.Explicit:  # out sharded like q (unsharded q: unsharded)
            spec = tuple(getattr(args_i[0].sharding, "spec", ()))[:3]
            got = tuple(getattr(outs[0].sharding, "spec", ()))[:3]
            assert got + (None,) * (3 - len(got)) == spec + (None,) * (3 - len(spec)), (
                outs[0].sharding, args_i[0].sharding)


def _reference_spa(q, k, v, sinks, segment_ids, kv_segment_ids, positions, *, ref):
    return reference.attention(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               positions=positions, sinks=sinks, **ref)


#: A plain call of the README's usage; the explicit examples below change a few fields.
SPA_PLAIN = dict(
    kind="explicit-set-mesh", mesh="sp8", strategy="auto", ulysses_size=None, batch=2, seq=64,
    heads=4, kv_heads=2, head_dim=16, v_head_dim=None, dtype=jnp.float32, causal=True,
    window=None, documents=None, key_padding=False, positions=None, layout="auto", scale=None,
    softcap=None, sinks=None, return_lse=False, kernel="auto", block_sizes=None,
    batch_axes=None, placement="replicated", jit=True, steps=3, bad=None, seed=0)


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_sequence_parallel_attention_matches_reference(budget, tolerances):
    """Every drawn call of the global entry point equals the reference (outputs, lse and
    gradients, at every step of a jitted training loop) or is refused by name. Explicit
    examples walk paths users met first: a hybrid on a split axis (asked for, and chosen
    by "auto" for 4 heads on 8 devices) trained three steps, and float segment ids."""

    @_settings(budget, "spa")
    @given(spa_calls())
    @example({**SPA_PLAIN, "strategy": "hybrid", "ulysses_size": 4})
    @example({**SPA_PLAIN, "kind": "auto", "placement": "host", "steps": 2})
    @example({**SPA_PLAIN, "documents": "sorted", "bad": "float-segment-ids", "steps": 1,
              "placement": "host"})
    def check(case):
        _check_spa(case, tolerances)

    check()


# --- dot_product_attention: the drop-in, against jax.nn ----------------------------------------

@st.composite
def dpa_calls(draw):
    """One call of ``dot_product_attention`` with ``jax.nn``'s arguments (and ours)."""
    kind = draw(st.sampled_from(list(MESH_KINDS)))
    heads = draw(st.sampled_from(HEADS))
    q_len = draw(st.sampled_from(SEQS))
    return dict(
        kind=kind, mesh=draw(st.sampled_from(list(MESHES))),
        strategy=draw(st.sampled_from(("auto",) * 2 + tuple(REGISTRY))),
        rank=draw(st.sampled_from((4, 4, 3))), batch=draw(st.sampled_from((1, 2, 3))),
        q_len=q_len, kv_len=draw(st.sampled_from((q_len,) * 3 + SEQS)), heads=heads,
        kv_heads=draw(st.sampled_from([h for h in HEADS if heads % h == 0])),
        head_dim=draw(st.sampled_from(HEAD_DIMS)),  # jax.nn: one head dim for q, k and v
        dtype=draw(st.sampled_from(DTYPES)), is_causal=draw(st.booleans()),
        local_window_size=draw(st.sampled_from(WINDOWS)),
        lengths=draw(st.sampled_from((None, None, "q", "kv", "both"))),
        mask=draw(st.sampled_from((None, None, "keys", "heads", "broadcast"))),
        scale=draw(st.sampled_from((None, 0.3))), return_residual=draw(st.booleans()),
        placement=draw(st.sampled_from(("host", "replicated", "sharded", "heads"))),
        jit=draw(st.sampled_from((True, True, False))), steps=draw(st.sampled_from((1, 2))),
        seed=draw(st.integers(0, 2**16)))


def _dpa_refusal(c) -> Optional[Refusal]:
    if c["kind"] == "none":
        return None if c["strategy"] == "auto" else Refusal("strategy", either=True)
    _, _, seq_axes, batch_axis = MESHES[c["mesh"]]
    axes = (seq_axes,) if isinstance(seq_axes, str) else seq_axes
    shape = _mesh(c["mesh"], AxisType.Explicit).shape
    devices = math.prod(shape[a] for a in axes)
    reasons = []
    if c["q_len"] != c["kv_len"]:
        reasons.append(("length", False))
    per_head = c["mask"] == "heads" and c["heads"] > 1
    if per_head and c["strategy"] in ("ulysses", "hybrid"):
        reasons.append(("mask", False))
    kept = (c["placement"] == "heads" and c["rank"] == 4 and batch_axis is not None
            and c["heads"] % 2 == 0 and c["kv_heads"] % 2 == 0
            and (c["kind"] != "auto" or not c["jit"]))  # as in _spa_refusal
    # a per-head mask runs each head as a batch row
    heads = 1 if per_head else c["heads"] // 2 if kept else c["heads"]
    if c["strategy"] == "ulysses" and heads % devices:
        reasons.append(("heads", False))
    if c["strategy"] == "hybrid":
        if len(axes) != 2:
            reasons.append(("seq_axes", False))
        elif heads % shape[axes[1]]:
            reasons.append(("heads", False))
    return _refusal(reasons)


def _seen(residual):
    """Rows that see a key: jax.nn gives the others the mean of the values, we give zeros."""
    return residual.astype(jnp.float32) > -1e29


def _folded(out, residual):
    """One array carrying ``out`` and the residual's values where a row sees a key (jax.nn
    stops the residual's gradient; tests/test_dot_product.py holds ours)."""
    residual = jnp.where(_seen(residual), residual, 0)
    return out + jax.lax.stop_gradient(residual)[..., None]


def _jax_nn(q, k, v, mask, q_lengths, kv_lengths, *, residual, options):
    """``jax.nn.dot_product_attention``'s XLA path in float32, rows that see no key zeroed."""
    out, lse = jax.nn.dot_product_attention(
        q, k, v, mask=mask, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
        implementation="xla", return_residual=True, **options)
    out = jnp.where(_seen(lse)[..., None], out, 0)
    return _folded(out, lse) if residual else out


def _dpa_inputs(c):
    batch = 1 if c["rank"] == 3 else c["batch"]
    d = dv = c["head_dim"]
    q, k, v = checks.normals([(batch, c["q_len"], c["heads"], d),
                              (batch, c["kv_len"], c["kv_heads"], d),
                              (batch, c["kv_len"], c["kv_heads"], dv)], c["dtype"], c["seed"])
    rng = np.random.default_rng(c["seed"] + 1)
    mask = None
    if c["mask"] is not None:
        shape = {"keys": (batch, 1, 1, c["kv_len"]), "heads": (batch, c["heads"], 1, c["kv_len"]),
                 "broadcast": (1, 1, 1, c["kv_len"])}[c["mask"]]
        mask = jnp.asarray(rng.random(shape) < 0.75)
    q_lengths = kv_lengths = None
    if c["lengths"] in ("q", "both"):
        q_lengths = jnp.asarray(rng.integers(0, c["q_len"] + 1, batch), jnp.int32)
    if c["lengths"] in ("kv", "both"):
        kv_lengths = jnp.asarray(rng.integers(0, c["kv_len"] + 1, batch), jnp.int32)
    if c["rank"] == 3:
        q, k, v = q[0], k[0], v[0]
        mask = None if mask is None else mask[0]
    return (q, k, v, mask, q_lengths, kv_lengths)


def _check_dpa(c, tolerances):
    args = _dpa_inputs(c)
    axis_type, under_mesh = MESH_KINDS[c["kind"]]
    mesh = None if axis_type is None else _mesh(c["mesh"], axis_type)
    _, _, seq_axes, batch_axis = MESHES[c["mesh"]]
    options = dict(is_causal=c["is_causal"], local_window_size=c["local_window_size"],
                   scale=c["scale"])
    ours_static = dict(options, strategy=c["strategy"], return_residual=c["return_residual"])
    if mesh is not None:
        ours_static["seq_axes"] = seq_axes

    def build():
        def attend(q, k, v, mask, q_lengths, kv_lengths):
            result = jax_seqpar.dot_product_attention(
                q, k, v, mask=mask, query_seq_lengths=q_lengths,
                key_value_seq_lengths=kv_lengths, mesh=mesh, **ours_static)
            return _folded(*result) if c["return_residual"] else result
        return _vjp_step(attend, (0, 1, 2))

    key = ("dpa", c["kind"], c["mesh"], repr(sorted(ours_static.items(), key=str)))
    step = _cached(key, build) if c["jit"] else build()
    # jax.nn's batch-free (rank 3) layout: the sharded dims move one to the left
    placed = tuple(_place(x, mesh, c["placement"] if c["rank"] == 4 else "replicated",
                          seq_axes, batch_axis) for x in args[:3]) + args[3:]
    shape = args[0].shape[:-1] + args[2].shape[-1:]
    cotangent = checks.normal(shape, c["dtype"], seed=c["seed"] + 2)
    under = (lambda: jax.set_mesh(mesh)) if under_mesh else contextlib.nullcontext
    steps, _ = _call_result(lambda: _run_steps(step, placed, cotangent, c["steps"], under),
                            _dpa_refusal(c))
    if steps is None:
        return
    oracle = _cached(("jax.nn", repr(sorted(options.items(), key=str)), c["return_residual"]),
                     lambda: _vjp_step(functools.partial(
                         _jax_nn, residual=c["return_residual"], options=options), (0, 1, 2)))
    for args_i, out, grads in steps:
        _assert_on_callers_mesh((out, grads), mesh)
        host = checks.upcast(tuple(jnp.asarray(np.asarray(x)) for x in args_i[:3]))
        want_out, want_grads, _ = oracle((*host, *args[3:]), cotangent.astype(jnp.float32))
        assert out.dtype == c["dtype"] and out.shape == shape, (out.dtype, out.shape, shape)
        _assert_close(out, want_out, tolerances, c["dtype"], "out")
        for x, got, want in zip(args_i, grads, want_grads):
            assert got.dtype == x.dtype and got.shape == x.shape
            _assert_close(got, want, tolerances, c["dtype"], "grad")


DPA_PLAIN = dict(
    kind="none", mesh="sp8", strategy="auto", rank=4, batch=1, q_len=64, kv_len=64, heads=8,
    kv_heads=8, head_dim=16, dtype=jnp.float32, is_causal=False, local_window_size=None,
    lengths="q", mask=None, scale=None, return_residual=False, placement="host", jit=True,
    steps=1, seed=0)


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_dot_product_attention_matches_jax_nn(budget, tolerances):
    """Every drawn call of the drop-in equals ``jax.nn.dot_product_attention`` (rows that
    see no key: zeros), outputs and gradients, or is refused by name. Explicit examples:
    ``query_seq_lengths`` alone, with ``T == S`` and ``T != S``, and with a mesh."""

    @_settings(budget, "dpa")
    @given(dpa_calls())
    @example(DPA_PLAIN)
    @example({**DPA_PLAIN, "q_len": 16})
    @example({**DPA_PLAIN, "kind": "explicit-set-mesh", "strategy": "ring", "batch": 2})
    def check(case):
        _check_dpa(case, tolerances)

    check()


# --- the Flax layers, trained a few jitted steps ------------------------------------------------

@st.composite
def flax_calls(draw):
    """A Flax layer (``SelfAttention``, or ``nnx.MultiHeadAttention`` with our
    ``attention_fn``), made outside or inside ``jax.set_mesh``, trained 2-3 steps."""
    heads = draw(st.sampled_from(HEADS))
    layer = draw(st.sampled_from(("self_attention", "multi_head")))
    kind = draw(st.sampled_from(list(MESH_KINDS)))
    return dict(
        layer=layer, kind=kind, made=draw(st.sampled_from(("outside", "inside"))),
        mesh=draw(st.sampled_from(list(MESHES))),
        strategy="auto" if kind == "none" else draw(
            st.sampled_from(("auto",) * 2 + tuple(REGISTRY))),
        heads=heads, kv_heads=draw(st.sampled_from([h for h in HEADS if heads % h == 0])),
        head_dim=draw(st.sampled_from(HEAD_DIMS)), batch=draw(st.sampled_from((1, 2))),
        seq=draw(st.sampled_from(SEQS)), dtype=draw(st.sampled_from((None, jnp.bfloat16))),
        causal=draw(st.booleans()), window=draw(st.sampled_from(WINDOWS)),
        softcap=draw(st.sampled_from((None, 5.0))),
        sinks=layer == "self_attention" and draw(st.booleans()),
        documents=layer == "self_attention" and draw(st.booleans()),
        positions=layer == "self_attention" and draw(st.booleans()),
        steps=draw(st.sampled_from((2, 3))), seed=draw(st.integers(0, 2**16)))


def _flax_refusal(c) -> Optional[Refusal]:
    if c["kind"] == "none":
        return None
    _, _, seq_axes, _ = MESHES[c["mesh"]]
    axes = (seq_axes,) if isinstance(seq_axes, str) else seq_axes
    shape = _mesh(c["mesh"], AxisType.Explicit).shape
    if c["strategy"] == "ulysses" and c["heads"] % math.prod(shape[a] for a in axes):
        return Refusal("heads")
    if c["strategy"] == "hybrid":
        if len(axes) != 2:
            return Refusal("seq_axes")
        if c["heads"] % shape[axes[1]]:
            return Refusal("heads")
    return None


def _reference_attention_fn(c):
    """Flax's ``attention_fn`` contract over the dense reference."""

    def attention_fn(query, key, value, *args, dtype=None, is_causal=False, **kwargs):
        return reference.attention(query, key, value, causal=c["causal"] or is_causal,
                                   window=c["window"], softcap=c["softcap"]).astype(query.dtype)

    return attention_fn


def _reference_self_attention(layer, x, segment_ids, positions):
    """``SelfAttention``'s forward with the dense reference in place of the strategy."""
    from jax_seqpar.flax import apply_rope

    rope = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None else positions
    q = apply_rope(layer.q_proj(x), rope, base=layer.rope_base)
    k = apply_rope(layer.k_proj(x), rope, base=layer.rope_base)
    v = layer.v_proj(x)
    out = reference.attention(
        q, k, v, causal=layer.causal, window=layer.window, softcap=layer.softcap,
        segment_ids=segment_ids, positions=positions,
        sinks=None if layer.sinks is None else layer.sinks[...]).astype(q.dtype)
    return layer.o_proj(out)


def _weighted_mean(y):
    """A loss whose gradient reaches every output with its own weight (a mean: the SGD
    steps stay small)."""
    weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.mean(y.astype(jnp.float32) * weights)


def _apply(model, x, segment_ids, positions):
    if isinstance(model, SelfAttention):
        return model(x, segment_ids=segment_ids, positions=positions)
    return model(x, deterministic=True)


@nnx.jit
def _forward(model, x, segment_ids, positions):
    """An evaluation step: the model goes in and (unchanged) comes back out of ``nnx.jit``."""
    return _apply(model, x, segment_ids, positions)


@nnx.jit
def _train_step(model, optimizer, x, segment_ids, positions):
    def loss(model):
        y = _apply(model, x, segment_ids, positions)
        return _weighted_mean(y), y

    (value, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return value, y, grads


@nnx.jit
def _reference_step(model, x, segment_ids, positions):
    def loss(model):
        y = _reference_self_attention(model, x, segment_ids, positions) if isinstance(
            model, SelfAttention) else model(x, deterministic=True)
        return _weighted_mean(y), y

    (value, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, y, grads


def _flax_layer(c, mesh, attention_fn=None):
    d_model = 32
    options = dict(dtype=c["dtype"], rngs=nnx.Rngs(c["seed"]))
    if c["layer"] == "self_attention":
        strategy = {} if mesh is None else dict(seq_axes=MESHES[c["mesh"]][2],
                                                strategy=c["strategy"])
        return SelfAttention(d_model, c["heads"], num_kv_heads=c["kv_heads"],
                             head_dim=c["head_dim"], mesh=mesh, causal=c["causal"],
                             window=c["window"], softcap=c["softcap"], sinks=c["sinks"],
                             **strategy, **options)
    if attention_fn is None:
        strategy = {} if mesh is None else dict(seq_axes=MESHES[c["mesh"]][2],
                                                strategy=c["strategy"])
        attention_fn = make_attention_fn(mesh, causal=c["causal"], window=c["window"],
                                         softcap=c["softcap"], **strategy)
    return nnx.MultiHeadAttention(c["heads"], d_model, c["heads"] * c["head_dim"],
                                  num_kv_heads=c["kv_heads"], decode=False,
                                  attention_fn=attention_fn, **options)


def _check_flax(c, tolerances):
    axis_type, under_mesh = MESH_KINDS[c["kind"]]
    mesh = None if axis_type is None else _mesh(c["mesh"], axis_type)
    under = (lambda: jax.set_mesh(mesh)) if under_mesh else contextlib.nullcontext
    refusal = _flax_refusal(c)
    with under() if c["made"] == "inside" else contextlib.nullcontext():
        model, error = _call_result(  # refused when made, or at the first step
            lambda: _flax_layer(c, mesh),
            None if refusal is None else Refusal(refusal.argument, either=True))
        if model is not None:
            optimizer = nnx.Optimizer(model, optax.sgd(STEP_SIZE), wrt=nnx.Param)
    if error is not None:
        return
    twin = None if c["layer"] == "self_attention" else nnx.graphdef(
        _flax_layer(c, None, _reference_attention_fn(c)))
    rng = np.random.default_rng(c["seed"])
    x = checks.normal((c["batch"], c["seq"], 32), seed=c["seed"] + 1)
    segment_ids = positions = None
    if c["documents"]:
        segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, (c["batch"], c["seq"])), 1),
                                  jnp.int32)
    if c["positions"]:
        positions = jnp.asarray(np.stack([rng.permutation(c["seq"])
                                          for _ in range(c["batch"])]), jnp.int32)
    dtype = c["dtype"] or jnp.float32
    for step in range(c["steps"]):
        state = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), nnx.state(model))
        oracle = nnx.merge(nnx.graphdef(model) if twin is None else twin, state)
        want = _reference_step(oracle, x, segment_ids, positions)
        with under():  # an evaluation step, then a training step, as a loop runs them
            evaluated, _ = _call_result(lambda: _forward(model, x, segment_ids, positions),
                                        refusal if step == 0 else None)
            if evaluated is None:
                return
            _assert_on_callers_mesh((evaluated, nnx.state(model)), mesh)
            result = _train_step(model, optimizer, x, segment_ids, positions)
        _assert_on_callers_mesh((result, nnx.state(model)), mesh)
        (_, y, grads), (_, want_y, want_grads) = result, want
        _assert_close(evaluated, want_y, tolerances, dtype, "out", float(np.abs(want_y).max()))
        # Projections accumulate before and after attention: the layer's output and its
        # parameters' gradients are compared relative to their largest element (a bias
        # of the keys has a zero gradient in exact arithmetic, rounding noise in both).
        assert y.dtype == want_y.dtype and y.shape == want_y.shape
        _assert_close(y, want_y, tolerances, dtype, "out", float(np.abs(want_y).max()))
        got_leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
        assert len(got_leaves) == len(want_leaves) > 0
        largest = max(float(np.abs(np.asarray(g, np.float32)).max()) for g in want_leaves)
        for got, want_grad in zip(got_leaves, want_leaves):
            assert got.shape == want_grad.shape and got.dtype == want_grad.dtype
            _assert_close(got, want_grad, tolerances, dtype, "grad", largest)


FLAX_PLAIN = dict(
    layer="self_attention", kind="explicit-set-mesh", made="outside", mesh="sp8",
    strategy="auto", heads=4, kv_heads=4, head_dim=16, batch=2, seq=64, dtype=None,
    causal=True, window=None, softcap=None, sinks=False, documents=False, positions=False,
    steps=2, seed=0)


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_flax_layers_train_like_reference(budget, tolerances):
    """Every drawn Flax layer trains a few ``nnx.jit`` steps whose outputs and gradients
    equal the dense reference's at the same parameters, or is refused by name. Explicit
    examples: 4 heads on 8 devices ("auto" picks a hybrid on the split axis), the layer
    made before ``jax.set_mesh``, as ``SelfAttention`` and as ``nnx.MultiHeadAttention``."""

    @_settings(budget, "flax")
    @given(flax_calls())
    @example(FLAX_PLAIN)
    @example({**FLAX_PLAIN, "layer": "multi_head"})
    def check(case):
        _check_flax(case, tolerances)

    check()
