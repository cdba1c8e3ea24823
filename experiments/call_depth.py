"""How deep one traced call goes into the package: frames on the stack, modules entered,
and how often each argument check runs.

One jitted ring forward (causal, one ``segment_ids`` array) on 8 emulated devices is
traced under :func:`sys.setprofile`; every frame whose code lives in ``jax_seqpar/`` is
counted.

    python experiments/call_depth.py [--kernel xla|auto]
"""

import argparse
import collections
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_seqpar  # noqa: E402

PACKAGE = os.path.dirname(jax_seqpar.__file__) + os.sep


def measure(kernel: str) -> dict:
    """``{"frames", "modules", "checks"}`` of one traced ring forward with ``kernel``."""
    mesh = jax.make_mesh((8,), ("sp",))
    q = k = v = jnp.ones((1, 64, 2, 8), jnp.float32)
    segment_ids = jnp.zeros((1, 64), jnp.int32)

    def f(q, k, v, segment_ids):
        return jax_seqpar.sequence_parallel_attention(
            q, k, v, mesh=mesh, strategy="ring", causal=True, segment_ids=segment_ids,
            kernel=kernel)

    depth, deepest, modules, checks = 0, 0, set(), collections.Counter()

    def profile(frame, event, arg):
        nonlocal depth, deepest
        if event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return
        if event == "call":
            depth += 1
            deepest = max(deepest, depth)
            modules.add(path[len(PACKAGE):])
            if path.endswith(os.path.join("core", "checks.py")):
                checks[frame.f_code.co_name] += 1
        else:
            depth -= 1

    with jax.set_mesh(mesh):
        traced = jax.jit(f)
        sys.setprofile(profile)
        try:
            traced.trace(q, k, v, segment_ids)
        finally:
            sys.setprofile(None)
    return {"frames": deepest, "modules": sorted(modules), "checks": dict(checks)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="xla")
    args = parser.parse_args()
    result = measure(args.kernel)
    print(f"kernel={args.kernel}: {result['frames']} package frames deep, "
          f"{len(result['modules'])} modules entered")
    print("modules:", " ".join(result["modules"]))
    print("checks:", result["checks"])


if __name__ == "__main__":
    main()
