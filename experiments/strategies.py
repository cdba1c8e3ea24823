"""Every strategy on one shape and the 8-device mesh, measured (a thin script over bench).

For q ``[1, 4096, 8, 64]``, k/v ``[1, 4096, 2, 64]`` (GQA), float32, causal, on 8
emulated CPU devices split as ``sp=8`` (Ulysses, ring, all-gather) and as
``dcn=2,ici=4`` (hybrid: ring over dcn, Ulysses over ici), prints one table:
fwd and fwd+bwd time (median), per-device temp memory, bytes per device read from
the compiled HLO next to ``jax_seqpar.comm_bytes``, the max error against the reference
and ``plan.plan``'s choice with its reason. CPU times show the relative cost of
the strategies' local work and copies, not network time (the devices share one
host). Options are those of ``jax-seqpar bench`` (``--help``).

    PYTHONPATH=. python experiments/strategies.py
"""

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax_seqpar.tools import bench_report  # noqa: E402  (after XLA_FLAGS)


def main(argv=None) -> int:
    parser = bench_report.add_bench_arguments(argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    parser.set_defaults(mesh=["sp=8", "dcn=2,ici=4"], seq=[4096], heads=8, kv_heads=2,
                        head_dim=64)
    return bench_report.run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
