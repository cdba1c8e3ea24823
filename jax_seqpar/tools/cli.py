"""The ``jax-seqpar`` command.

Subcommands::

  demo   train a small byte-level LM unsharded and with sequence-parallel
         strategies (ulysses, ring, hybrid unless told) on emulated CPU devices,
         and compare the loss curves.
  bench  time, memory and traffic of every strategy, next to the cost model;
         or compiled for a GPU/TPU target without running (--target).
  tune   predict every strategy and factorization, time the best, cache the winner.
  generate  greedy text from the demo LM, decoding against a sequence-sharded KV cache.
  check  this machine's accelerator kernel and every strategy against the reference.

The work lives in :mod:`jax_seqpar.examples` and :mod:`jax_seqpar.tools.bench_report`;
this module only parses arguments and prepares the JAX environment before a
backend starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

from jax_seqpar.tools.cli_options import HelpFormatter, default_out_dir, positive_int

__all__ = ["build_parser", "main"]

DEMO_DEVICES = 8
#: The strategies ``jax-seqpar demo`` trains without ``--strategies`` (those of
#: ``jax_seqpar.examples.run_demo``; a test holds them equal).
DEMO_STRATEGIES = ("ulysses", "ring", "hybrid")
#: What ``demo --compute-dtype`` takes (``jax_seqpar.core.quant.COMPUTE_DTYPES``, named
#: here so that the parser imports no JAX; a test holds them equal).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
#: What ``demo`` and ``generate`` write in their ``--out`` folder.
DEMO_PLOT = "demo-losses.png"
GENERATE_PARAMS = "demo-lm-params.npz"


def _demo(args: argparse.Namespace) -> int:
    from jax_seqpar.tools.targets import emulate_cpu_devices

    emulate_cpu_devices(DEMO_DEVICES, cpu_only=True)
    from jax_seqpar import examples as demo

    try:
        strategies = demo.as_strategy_list(args.strategies)
    except ValueError as error:
        print(f"jax-seqpar demo: {error}", file=sys.stderr)
        return 2
    from jax_seqpar.examples import ModelConfig

    model_config = ModelConfig(num_layers=args.layers, local_window=args.local_window,
                               global_every=args.global_every)
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    demo.run_demo(steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                  strategies=strategies, out=os.path.join(args.out, DEMO_PLOT), seed=args.seed,
                  progress=not args.no_progress, fsdp=args.fsdp, model_config=model_config,
                  packed=args.packed, mask=args.mask, compute_dtype=args.compute_dtype)
    print(f"demo wall time: {time.perf_counter() - start:.1f} s")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jax_seqpar.tools.targets import emulate_cpu_devices

    emulate_cpu_devices(DEMO_DEVICES, cpu_only=True)
    from jax_seqpar.examples import run_generate

    if not args.no_save:
        os.makedirs(args.out, exist_ok=True)
    params_path = None if args.no_save else os.path.join(args.out, GENERATE_PARAMS)
    try:
        run_generate(prompt=args.prompt, num_tokens=args.tokens, strategy=args.strategy,
                     params_path=params_path,
                     train_steps=args.train_steps, seed=args.seed)
    except ValueError as error:
        print(f"jax-seqpar generate: {error}", file=sys.stderr)
        return 2
    return 0


def _add_generate(commands) -> None:
    from jax_seqpar.api.attention import STRATEGIES

    generate = commands.add_parser(
        "generate",
        help="greedy text from the demo LM, decoding against a sequence-sharded KV cache",
        description=(
            f"Load the byte-level LM's parameters from --out/{GENERATE_PARAMS} (or train it "
            "briefly on one device and save them there), prefill the prompt sequence-parallel "
            f"over {DEMO_DEVICES} emulated CPU devices, then decode greedily against the KV cache "
            "sharded along the sequence. Prints the text and tokens/s."),
        formatter_class=HelpFormatter)
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--tokens", type=positive_int, default=64,
                          help="bytes to generate")
    generate.add_argument("--strategy", default="auto",
                          choices=STRATEGIES,
                          help="prefill strategy (hybrid: 2 x 4 ('dcn', 'ici') mesh)")
    generate.add_argument("--out", metavar="DIR", default=default_out_dir(),
                          help=f"folder of the parameters file {GENERATE_PARAMS}: loaded if "
                               "present, else written after training")
    generate.add_argument("--no-save", action="store_true",
                          help="train every time; neither load nor write parameters")
    generate.add_argument("--train-steps", type=positive_int, default=150,
                          help="training steps when no parameters file exists")
    generate.add_argument("--seed", type=int, default=0, help="parameters and data order")
    generate.set_defaults(run=_generate)


def build_parser() -> argparse.ArgumentParser:
    """The ``jax-seqpar`` argument parser (one subparser per subcommand)."""
    parser = argparse.ArgumentParser(
        prog="jax-seqpar", formatter_class=HelpFormatter,
        description="Sequence-parallel exact attention for JAX: demos and tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small LM unsharded and sequence-parallel; compare the losses",
        description=(
            "Train a small byte-level decoder LM on Python's standard-library sources, "
            "packed into long rows with segment ids, from the same initial parameters: "
            "once without sequence parallelism and once per strategy of --strategies, with the "
            f"sequence split over {DEMO_DEVICES} emulated CPU devices (XLA_FLAGS="
            f"--xla_force_host_platform_device_count={DEMO_DEVICES} unless already set; "
            "JAX_PLATFORMS=cpu unless set). Prints the "
            "losses at matching steps, the largest loss difference from the unsharded run, "
            "tokens/s, and writes a loss-curve PNG."),
        formatter_class=HelpFormatter)
    demo.add_argument("--steps", type=positive_int, default=40, help="optimizer steps per run")
    demo.add_argument("--seq-len", type=positive_int, default=1024,
                      help="tokens per row (a multiple of 2 x devices)")
    demo.add_argument("--batch", type=positive_int, default=4, help="rows per batch")
    demo.add_argument("--strategies", default=",".join(DEMO_STRATEGIES),
                      help="comma-separated strategies from auto, ulysses, ring, hybrid, "
                           "allgather (hybrid: 2 x 4 ('dcn', 'ici') mesh)")
    demo.add_argument("--out", metavar="DIR", default=default_out_dir(),
                      help=f"folder the loss-curve PNG ({DEMO_PLOT}) is written to")
    demo.add_argument("--seed", type=int, default=0, help="parameters and data order")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    demo.add_argument("--fsdp", action="store_true",
                      help="also shard parameters and optimizer state over the devices that "
                           "split the sequence (FSDP / ZeRO-3) and print their per-device "
                           "memory, sharded vs replicated")
    demo.add_argument("--packed", action="store_true",
                      help="put every batch in the per-document order of its packed "
                           "documents (balanced causal work per device) instead of zigzag, "
                           "and print both orders' busiest/mean work per device")
    demo.add_argument("--mask", choices=("chunked", "prefix", "vlm"), default=None,
                      help="train with a mask beyond causal (default: causal only): chunked (the "
                           "local layers causal within chunks of seq-len/4 tokens, Llama 4), "
                           "prefix (each document's first quarter bidirectional, prefix-LM) or "
                           "vlm (image-like bidirectional spans amid causal text)")
    demo.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default=None,
                      help="attention's matrix products in this dtype (FP8 scaled per token; "
                           "softmax and sums in float32) in an extra unsharded run and every "
                           "strategy's; the plain unsharded run is the baseline")
    demo.add_argument("--layers", type=positive_int, default=2, help="Transformer blocks")
    demo.add_argument("--local-window", type=positive_int, default=None,
                      help="make layers local (causal sliding window of this many past tokens) "
                           "except every --global-every-th, which stays global (default: every "
                           "layer global)")
    demo.add_argument("--global-every", type=positive_int, default=2,
                      help="with --local-window: one global layer in this many (Gemma 3: 6)")
    demo.set_defaults(run=_demo)
    _add_generate(commands)

    from jax_seqpar.tools import bench_report

    bench = commands.add_parser(
        "bench",
        help="time, memory and traffic of every strategy, next to the cost model; or "
             "compiled (not run) for a GPU/TPU target",
        description=bench_report.DESCRIPTION,
        formatter_class=HelpFormatter)
    bench_report.add_bench_arguments(bench)
    bench.set_defaults(run=bench_report.run_bench)

    from jax_seqpar.tools import tune_report

    tune = commands.add_parser(
        "tune", help="predict every strategy and factorization, time the best, cache the winner",
        description=tune_report.DESCRIPTION,
        formatter_class=HelpFormatter)
    tune_report.add_tune_arguments(tune)
    tune.set_defaults(run=tune_report.run_tune)

    from jax_seqpar.tools import check

    checker = commands.add_parser(
        "check", help="this machine's accelerator kernel and every strategy against the "
                      "reference (the check for a GPU or TPU machine)",
        description=check.DESCRIPTION, formatter_class=HelpFormatter)
    check.add_check_arguments(checker)
    checker.set_defaults(run=check.run_check)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``jax-seqpar``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
