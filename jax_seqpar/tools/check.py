"""``jax-seqpar check``: this machine's kernel and every strategy against the reference.

The check for a machine with an accelerator: the tests run on emulated CPU devices, where
the Triton and Mosaic kernels run in the Pallas interpreter, so only here are they
compiled and run. Two parts, one line printed per case:

1. The kernel alone (``pallas`` on a GPU, ``mosaic`` on a TPU) at every head dim it
   serves, causal with packed documents and GQA, plus soft-cap, a sliding window on a
   ragged length, float32, non-causal MHA and a one-query decode row: ``out``, ``lse``
   and the gradients against :func:`jax_seqpar.core.reference.attention` (float32, on
   the same device).
2. Every strategy through :func:`jax_seqpar.sequence_parallel_attention` over all
   local devices, with that kernel and with ``"xla"``: output and gradients.

The error is ``max |got - reference| / max |reference|``, against :data:`TOLERANCE`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

if TYPE_CHECKING:  # annotations only
    import jax

    from jax_seqpar.kernels import KernelName
    from jax_seqpar.strategies.registry import StrategyName

__all__ = ["Case", "DESCRIPTION", "HEAD_DIMS", "KERNEL_OF_PLATFORM", "QUICK_HEAD_DIMS", "TOLERANCE", "add_check_arguments", "check_kernel", "check_strategy", "kernel_cases", "relative_error", "run_check"]

#: The kernel each accelerator platform compiles.
KERNEL_OF_PLATFORM: dict[str, KernelName] = {"gpu": "pallas", "tpu": "mosaic"}
#: The head dims ``(Dqk, Dv)`` the accelerator kernels serve (standard heads, DeepSeek's
#: 192/128 and MLA absorbed 576/512).
HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128),
             (576, 512))
QUICK_HEAD_DIMS = ((64, 64), (128, 128), (576, 512))
#: Largest ``max |error| / max |reference|`` accepted, by input dtype and result kind
#: (gradients sum over the sequence, so bf16/fp16 ones get more room).
TOLERANCE = {"float32": {"out": 1e-3, "grad": 1e-3},
             "bfloat16": {"out": 2e-2, "grad": 5e-2},
             "float16": {"out": 2e-2, "grad": 5e-2}}


class Case(NamedTuple):
    """One kernel call: global sizes, dtype, mask and the kernel under test (``q_len`` <
    ``seq``: the queries are the last ``q_len`` tokens, e.g. 1 for a decode row)."""

    d_qk: int
    d_v: int
    dtype: str = "bfloat16"
    seq: int = 1024
    heads: int = 8
    kv_heads: int = 2
    causal: bool = True
    window: Optional[int] = None
    segments: bool = True
    q_len: Optional[int] = None
    softcap: Optional[float] = None
    kernel: KernelName = "xla"

    def label(self) -> str:
        extras = [f"{name}={value}" for name, value in (("window", self.window),
                  ("softcap", self.softcap)) if value is not None]
        return (f"{self.d_qk}/{self.d_v} {self.dtype} "
                f"Sq={self.q_len or self.seq} Sk={self.seq} H={self.heads} "
                f"Hkv={self.kv_heads} {'causal' if self.causal else 'full'} "
                + " ".join(extras + (["segments"] if self.segments else []))).strip()


def kernel_cases(platform: str, *, quick: bool = False, seq: int = 1024) -> list[Case]:
    """The kernel cases of ``platform`` (float16: not on TPU, where Mosaic takes float32
    and bfloat16 only)."""
    dtypes = ("bfloat16",) if platform == "tpu" else ("bfloat16", "float16")
    cases = [Case(d_qk, d_v, dtype, seq, heads=4 if d_qk > 256 else 8,
                  kv_heads=1 if d_qk > 256 else 2)
             for d_qk, d_v in (QUICK_HEAD_DIMS if quick else HEAD_DIMS) for dtype in dtypes]
    return cases + [
        Case(128, 128, "bfloat16", seq, softcap=20.0),
        Case(128, 128, "float32", seq),
        Case(128, 128, "bfloat16", seq, heads=4, kv_heads=4, causal=False, segments=False),
        Case(64, 64, "bfloat16", seq - seq // 16, heads=4, kv_heads=1,
             window=max(1, seq // 4), segments=False),
        Case(128, 128, "bfloat16", seq, kv_heads=1, q_len=1),  # a decode row, MQA
    ]


def relative_error(got: jax.typing.ArrayLike, wanted: jax.typing.ArrayLike) -> float:
    """``max |got - wanted| / max |wanted|`` in float32."""
    import numpy as np

    got, wanted = np.asarray(got, np.float32), np.asarray(wanted, np.float32)
    return float(np.max(np.abs(got - wanted)) / max(float(np.max(np.abs(wanted))), 1e-6))


def _report(label: str, dtype: str, errors: dict, print_fn: Callable[[str], None] = print) -> bool:
    limits = TOLERANCE[dtype]
    ok = all(err <= limits["grad" if name.startswith("d") else "out"]
             for name, err in errors.items())
    detail = " ".join(f"{name}={err:.1e}" for name, err in errors.items())
    print_fn(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}")
    return ok


def _grads_of(fn, inputs, weights):
    """``{out, [lse,] dq, dk, dv}`` of ``<fn(q, k, v), weights>`` under ``jax.jit``."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        results = fn(q, k, v)
        results = results if isinstance(results, tuple) else (results,)
        total = sum(jnp.sum(r.astype(jnp.float32) * w) for r, w in zip(results, weights))
        return total, results

    grads, results = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*inputs)
    return dict(zip(("out", "lse"), results), dq=grads[0], dk=grads[1], dv=grads[2])


def check_kernel(case: Case, print_fn: Callable[[str], None] = print) -> bool:
    """``case.kernel`` on ``case`` against the reference: out, lse, dq, dk, dv."""
    import jax
    import jax.numpy as jnp

    from jax_seqpar import kernels
    from jax_seqpar.core import reference
    from jax_seqpar.core.masks import MaskSpec, Tokens

    q_len = case.q_len or case.seq
    keys = jax.random.split(jax.random.key(case.d_qk + case.seq), 5)
    q = jax.random.normal(keys[0], (2, q_len, case.heads, case.d_qk), case.dtype)
    k = jax.random.normal(keys[1], (2, case.seq, case.kv_heads, case.d_qk), case.dtype)
    v = jax.random.normal(keys[2], (2, case.seq, case.kv_heads, case.d_v), case.dtype)
    weights = (jax.random.normal(keys[3], (2, q_len, case.heads, case.d_v)),
               jax.random.normal(keys[4], (2, q_len, case.heads)))
    positions = jnp.broadcast_to(jnp.arange(case.seq, dtype=jnp.int32), (2, case.seq))
    segments = ((positions >= case.seq // 3).astype(jnp.int32) if case.segments else None)
    kv_tokens = Tokens(positions, segments)
    q_tokens = Tokens(positions[:, case.seq - q_len:],
                      None if segments is None else segments[:, case.seq - q_len:])
    spec = MaskSpec.make(case.causal, None if case.window is None else (case.window, 0))
    scale = case.d_qk ** -0.5
    def ours(q, k, v):
        return kernels.attention(kernels.make_options(
            q, spec, scale=scale, kernel=case.kernel, softcap=case.softcap),
            q, k, v, q_tokens, kv_tokens)

    def theirs(q, k, v):
        return reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), causal=case.causal,
            window=spec.window, positions=q_tokens.positions,
            segment_ids=q_tokens.segment_ids, kv_positions=kv_tokens.positions,
            kv_segment_ids=kv_tokens.segment_ids, scale=scale, softcap=case.softcap,
            return_lse=True)

    label = f"kernel={case.kernel} {case.label()}"
    try:
        got, wanted = _grads_of(ours, (q, k, v), weights), _grads_of(theirs, (q, k, v), weights)
    except Exception as error:  # a case the kernel cannot compile is a failed check
        print_fn(f"FAIL {label}: {type(error).__name__}: "
                 f"{str(error).splitlines()[0][:200] if str(error) else ''}")
        return False
    return _report(label, case.dtype,
                   {name: relative_error(got[name], wanted[name]) for name in got}, print_fn)


def check_strategy(strategy: StrategyName, case: Case,
                   print_fn: Callable[[str], None] = print) -> bool:
    """``strategy`` over every local device (hybrid: a ``(2, P/2)`` mesh) with ``case``'s
    sizes, dtype and kernel (``d_qk`` the head dim), causal with packed documents, against
    the reference: out, dq, dk, dv."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_seqpar.api.attention import sequence_parallel_attention
    from jax_seqpar.core import reference

    seq, heads, kv_heads, head_dim, dtype = (case.seq, case.heads, case.kv_heads, case.d_qk,
                                             case.dtype)
    devices = np.array(jax.devices())
    axes: str | tuple[str, str]
    if strategy == "hybrid":
        if len(devices) < 4 or len(devices) % 2:
            print_fn(f"skip {strategy}: needs an even number >= 4 of devices")
            return True
        mesh, axes = jax.sharding.Mesh(devices.reshape(2, -1), ("dcn", "ici")), ("dcn", "ici")
    else:
        mesh, axes = jax.sharding.Mesh(devices, ("sp",)), "sp"
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, seq, kv_heads, head_dim), dtype)
    weights = (jax.random.normal(keys[3], (1, seq, heads, head_dim)),)
    segments = (jnp.arange(seq, dtype=jnp.int32)[None] >= seq // 3).astype(jnp.int32)

    def ours(q, k, v):
        return sequence_parallel_attention(q, k, v, mesh=mesh, seq_axes=axes, strategy=strategy,
                                           causal=True, segment_ids=segments, kernel=case.kernel)

    def theirs(q, k, v):
        return reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True,
                                   segment_ids=segments)

    label = (f"{strategy} kernel={case.kernel} on {len(devices)} {devices.flat[0].platform} "
             f"devices S={seq} H={heads} Hkv={kv_heads} D={head_dim} {dtype}")
    try:
        got, wanted = _grads_of(ours, (q, k, v), weights), _grads_of(theirs, (q, k, v), weights)
    except Exception as error:
        print_fn(f"FAIL {label}: {type(error).__name__}: "
                 f"{str(error).splitlines()[0][:200] if str(error) else ''}")
        return False
    return _report(label, dtype, {name: relative_error(got[name], wanted[name])
                                  for name in got}, print_fn)


#: ``jax-seqpar check --help``'s description (plain text).
DESCRIPTION = (
    "Check this machine's accelerator kernel (Triton on a GPU, Mosaic on a TPU) and every "
    "strategy over all local devices against the reference attention, output and "
    "gradients: one line per case, exit status 1 if any case fails. The tests run on "
    "emulated CPU devices, where these kernels are interpreted; this compiles and runs "
    "them. Without an accelerator, --kernel names the kernel to check.")


def add_check_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``check`` options to ``parser`` (the ``jax-seqpar check`` subparser)."""
    from jax_seqpar.tools.cli_options import positive_int

    add = parser.add_argument
    add("--kernel", choices=("pallas", "mosaic", "xla"), default=None,
        help="the kernel to check (default: pallas on a GPU, mosaic on a TPU)")
    add("--quick", action="store_true",
        help=f"head dims {', '.join(f'{a}/{b}' for a, b in QUICK_HEAD_DIMS)} only")
    add("--kernel-seq", type=positive_int, default=1024,
        help="tokens of a kernel case; the strategy checks run 4x as many")
    add("--no-strategies", action="store_true", help="check the kernel alone")
    return parser


def run_check(args: argparse.Namespace) -> int:
    """Runs ``jax-seqpar check``; returns the exit status."""
    import jax

    from jax_seqpar.strategies.registry import STRATEGIES

    platform = jax.default_backend()
    kernel = args.kernel or KERNEL_OF_PLATFORM.get(platform)
    if kernel is None:
        print(f"jax-seqpar check: no accelerator (the default backend is {platform!r}); "
              "name a kernel with --kernel (pallas and mosaic run interpreted on CPU, "
              "slowly: use a small --kernel-seq).", file=sys.stderr)
        return 2
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
    start, ok = time.perf_counter(), True
    for case in kernel_cases(platform, quick=args.quick, seq=args.kernel_seq):
        ok &= check_kernel(case._replace(kernel=kernel))
    if not args.no_strategies:
        for strategy in STRATEGIES:
            for each in dict.fromkeys((kernel, "xla")):
                ok &= check_strategy(strategy, Case(128, 128, seq=4 * args.kernel_seq,
                                                    kernel=each))
    print(f"{'all ok' if ok else 'FAILURES'} ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1
