"""``jax-seqpar demo``: one model, trained unsharded and with every strategy, compared."""

from __future__ import annotations

import dataclasses
import typing
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jax_seqpar.api import attention as api
from jax_seqpar.core import work
from jax_seqpar.core.batch_layout import permute_batch
from jax_seqpar.core.masks import MaskSpec, Tokens
from jax_seqpar.core.extras import require
from jax_seqpar.examples._data import PackedRows, training_batches
from jax_seqpar.examples._model import ModelConfig, Parallelism
from jax_seqpar.examples._train import TrainConfig, TrainResult, init_params, mesh_for, train

UNSHARDED = "unsharded"
DEFAULT_STRATEGIES: tuple[api.StrategyChoice, ...] = ("ulysses", "ring", "hybrid")


def report_steps(steps: int, rows: int = 10) -> list[int]:
    """About ``rows`` evenly spaced 1-based steps, always the first and the last."""
    stride = max(1, steps // rows)
    return sorted({1, steps, *range(stride, steps + 1, stride)})


def format_table(results: dict[str, TrainResult], train_config: TrainConfig) -> str:
    """Losses at matching steps, then per run: max |loss - unsharded|, tokens/s (after the
    first step) and the first step's wall time (which includes compiling)."""
    names = list(results)
    width = max(11, *map(len, names)) + 2
    lines = ["step".rjust(6) + "".join(n.rjust(width) for n in names)]
    for step in report_steps(train_config.steps):
        lines.append(f"{step:6d}" + "".join(f"{results[n].losses[step - 1]:{width}.5f}"
                                            for n in names))
    base = results[UNSHARDED].losses if UNSHARDED in results else None
    lines.append("")
    lines.append(f"{'run':>{width}}  {'max|dloss| vs unsharded':>24}  {'relative':>9}  "
                 f"{'tokens/s':>9}  {'first step s':>12}")
    for name, result in results.items():
        diff = relative = "-"
        if base is not None and name != UNSHARDED:
            diff = f"{np.abs(result.losses - base).max():.2e}"
            relative = f"{max_relative_difference(result.losses, base):.2%}"
        lines.append(f"{name:>{width}}  {diff:>24}  {relative:>9}  "
                     f"{result.tokens_per_second:9.0f}  {result.compile_seconds:12.1f}")
    return "\n".join(lines)


def max_relative_difference(losses: np.ndarray, base: np.ndarray) -> float:
    """The largest ``|loss - base| / |base|`` over the steps (``[steps]`` each)."""
    return float(np.max(np.abs(losses - base) / np.abs(base)))


def format_state_memory(results: dict[str, TrainResult]) -> str:
    """Per-device parameter + optimizer-state bytes (from the compiled step's
    ``memory_analysis``) of every run, and of each FSDP run against its replicated twin."""
    lines = ["parameters + optimizer state per device (compiled step's arguments less the batch):"]
    for name, result in results.items():
        twin = results.get(name.removesuffix("+fsdp")) if name.endswith("+fsdp") else None
        ratio = f"  ({result.state_bytes / twin.state_bytes:.3f}x of replicated)" if twin else ""
        lines.append(f"{name:>16}: {result.state_bytes / 2**20:8.3f} MiB{ratio}")
    return "\n".join(lines)


def format_balance(data: PackedRows, num_shards: int) -> str:
    """Busiest/mean causal-within-document work per device over the run's batches, for
    the zigzag and the per-document order (:func:`jax_seqpar.core.work.work_per_shard`)."""
    ratios = {}
    for layout in ("zigzag", "per_document"):
        worst = []
        for segment_ids in data.segment_ids:  # [B, S] per step
            options = {"segment_ids": segment_ids} if layout == "per_document" else {}
            laid, positions = permute_batch(segment_ids, layout, num_shards, **options)
            counts = work.work_per_shard(MaskSpec(causal=True), Tokens(positions, laid),
                                         num_shards)
            worst.append(counts.max() / counts.mean())
        ratios[layout] = (float(np.median(worst)), float(max(worst)))
    return (f"busiest/mean causal work per device over {len(data.segment_ids)} batches "
            f"({num_shards} shards), median/worst: " + ", ".join(
                f"{name} {median:.3f}/{worst:.3f}" for name, (median, worst) in ratios.items()))


def plot_losses(results: dict[str, TrainResult], path: str) -> None:
    """Write the loss curves of every run to ``path`` (PNG, matplotlib Agg)."""
    matplotlib = require("matplotlib", "examples", "the demo's loss plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 2))]
    for (name, result), style in zip(results.items(), styles * len(results)):
        steps = np.arange(1, result.losses.size + 1)
        ax.plot(steps, result.losses, linestyle=style, linewidth=1.8, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("next-byte cross-entropy (nats)")
    ax.set_title("Same model, same data: unsharded vs sequence-parallel attention")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(
    *,
    steps: int = 40,
    seq_len: int = 1024,
    batch: int = 4,
    strategies: Sequence[api.StrategyChoice] = DEFAULT_STRATEGIES,
    out: str = "jax-seqpar-demo.png",
    seed: int = 0,
    model_config: ModelConfig = ModelConfig(),
    progress: bool = True,
    print_fn: Callable[[str], None] = print,
    fsdp: bool = False,
    packed: bool = False,
    mask: Optional[str] = None,
    compute_dtype: Optional[str] = None,
) -> dict[str, TrainResult]:
    """Train one byte-level LM from the same parameters and data, unsharded and with
    each strategy on all devices, then print a loss table and plot the curves.

    Args:
      steps, seq_len, batch, seed: the :class:`TrainConfig`.
      strategies: sequence-parallel strategies to compare with the unsharded run;
        ``"hybrid"`` uses a 2 x N/2 ``("dcn", "ici")`` mesh, the others one axis.
      out: path of the loss-curve PNG.
      model_config: the model.
      progress: show tqdm progress bars.
      print_fn: where the report goes.
      fsdp: also run each strategy with parameters and optimizer state sharded over
        its devices (run name ``"<strategy>+fsdp"``), and report their per-device
        bytes next to the replicated run's.
      packed: put every batch of the sequence-parallel runs in the per-document order
        of its segment ids (run name ``"<strategy>+packed"``) instead of zigzag, and
        report both orders' busiest/mean work per device.
      mask: train with one of ``jax_seqpar.examples.MASKS``: ``"prefix"``
        (prefix-LM documents, each one's prefix bidirectional), ``"vlm"`` (image-like
        bidirectional spans amid causal text) or ``"chunked"`` (the local layers causal
        within chunks of ``seq_len // 4`` tokens, unless ``model_config.chunk_size``
        says otherwise); None: plain causal.
      compute_dtype: attention's matrix products in this dtype (for example
        ``"float8_e4m3fn"``, :class:`jax_seqpar.examples.ModelConfig`) in an unsharded
        run named ``"unsharded+<dtype>"`` and in every strategy's run
        (``"<strategy>+<dtype>"``); the ``"unsharded"`` run keeps the model's own
        precision, the baseline of the table's relative loss difference. None: every
        run in the model's precision.

    Returns:
      ``{run name: TrainResult}``, the unsharded run first.

    .. code-block:: python

        results = run_demo(steps=10, seq_len=256, strategies=["ring"], out="losses.png")
    """
    train_config = TrainConfig(steps=steps, batch=batch, seq_len=seq_len, seed=seed)
    if mask == "chunked" and model_config.chunk_size is None:
        model_config = dataclasses.replace(model_config, chunk_size=max(1, seq_len // 4))
    devices = jax.devices()
    print_fn(f"{len(devices)} {devices[0].platform} devices; model {model_config}; "
             f"{train_config}" + ("" if mask is None else f"; mask {mask}"))
    data = training_batches(steps=steps, batch=batch, seq_len=seq_len, seed=seed, mask=mask)
    params = init_params(model_config, seed)
    computed = dataclasses.replace(model_config, compute_dtype=compute_dtype)
    runs = {UNSHARDED: (model_config, Parallelism())}
    suffix = "+packed" if packed else ""
    if compute_dtype is not None:
        suffix += f"+{compute_dtype}"
        runs[UNSHARDED + f"+{compute_dtype}"] = (computed, Parallelism())
    for strategy in strategies:
        mesh, seq_axes = mesh_for(strategy, devices)
        runs[strategy + suffix] = (computed, Parallelism(mesh, seq_axes, strategy,
                                                         per_document=packed))
        if fsdp:
            runs[f"{strategy}{suffix}+fsdp"] = (computed, Parallelism(
                mesh, seq_axes, strategy, fsdp=True, per_document=packed))
    results = {}
    for name, (config, parallelism) in runs.items():
        results[name] = train(config, train_config, parallelism, params=params,
                              data=data, progress=progress, description=f"{name:>9}")
    print_fn(format_table(results, train_config))
    if fsdp:
        print_fn(format_state_memory(results))
    if packed:
        print_fn(format_balance(data, len(devices)))
    plot_losses(results, out)
    print_fn(f"loss curves written to {out}")
    return results


def as_strategy_list(text: str) -> list[api.StrategyChoice]:
    """``"ulysses,ring"`` -> ``["ulysses", "ring"]`` (validated: ``ValueError`` naming
    the unknown ones)."""
    known = api.STRATEGIES
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {known}.")
    return [typing.cast(api.StrategyChoice, s) for s in names]  # each checked just above

