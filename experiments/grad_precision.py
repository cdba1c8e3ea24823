"""bf16 gradient error by P: every strategy against a float64 oracle.

For each strategy and P in (1, 2, 4, 8) emulated CPU devices, one jitted ``jax.grad`` of
``<sequence_parallel_attention(q, k, v, causal=True), dout>`` in the README's context
(an Explicit mesh inside ``jax.set_mesh``, unsharded bf16 inputs), and the max abs
error of dq, dk and dv against numpy float64 on the same inputs. P=1 is the same call
on a one-device mesh. The hybrid runs on a (P/I, I) mesh, ``hybrid-split`` splits one
axis (``ulysses_size=I``), I = max(1, P/2). The functions are those of
``tests/test_precision.py``, which holds P=8 within 1.25x of P=1.

    PYTHONPATH=. python experiments/grad_precision.py --seq-len 2048 --heads 8 --head-dim 64
"""

import argparse
import os
import pathlib
import subprocess
import sys

os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402

import test_precision as precision  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=precision.SHAPE["seq_len"])
    parser.add_argument("--heads", type=int, default=precision.SHAPE["num_heads"])
    parser.add_argument("--head-dim", type=int, default=precision.SHAPE["head_dim"])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--strategies", nargs="+", default=list(precision.STRATEGIES))
    a = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"python experiments/grad_precision.py {' '.join(sys.argv[1:])}")
    print(f"jax {jax.__version__}, commit {commit}; bf16, causal, B={a.batch}, "
          f"S={a.seq_len}, H={a.heads}, D={a.head_dim}; max abs error vs float64\n")
    args = precision.inputs(a.batch, a.seq_len, a.heads, a.head_dim)
    expected = precision.oracle(*args)
    print(f"{'strategy':<13} {'P':>2} {'dq':>8} {'dk':>8} {'dv':>8}")
    for strategy in a.strategies:
        for devices in a.devices:
            dq, dk, dv = precision.errors(strategy, devices, args, expected)
            print(f"{strategy:<13} {devices:>2} {dq:8.4f} {dk:8.4f} {dv:8.4f}", flush=True)


if __name__ == "__main__":
    main()
