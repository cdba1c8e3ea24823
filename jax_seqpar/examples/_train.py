"""Training loop: AdamW with warmup + cosine decay, sequence sharded over a mesh."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_seqpar.api.attention import StrategyChoice
from jax_seqpar.core.extras import require
from jax_seqpar.core.batch_layout import permute_batch
from jax_seqpar.examples._data import PackedRows, training_batches
from jax_seqpar.examples._model import ModelConfig, Parallelism, TransformerLM


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
      steps: optimizer steps (one fresh batch each).
      batch: rows per batch.
      seq_len: tokens per row (divisible by twice the number of sequence shards).
      peak_learning_rate: AdamW learning rate after warmup; cosine decay to 10% of it.
      warmup_steps: linear warmup from 0.
      weight_decay: AdamW decoupled weight decay (matrices only).
      seed: parameter initialization and data order.
    """

    steps: int = 40
    batch: int = 4
    seq_len: int = 1024
    peak_learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run produced.

    Attributes:
      losses: ``float32[steps]`` mean next-byte cross-entropy (nats) at each step,
        before that step's update.
      compile_seconds: wall time of the first step (tracing, compiling, running).
      seconds: wall time of the other steps.
      tokens_per_second: tokens of the other steps / ``seconds``.
      state_bytes: per-device bytes of the parameters and optimizer state, from
        the compiled step's ``memory_analysis`` (its arguments less the batch).
    """

    losses: np.ndarray
    compile_seconds: float
    seconds: float
    tokens_per_second: float
    state_bytes: int = 0


def mesh_for(strategy: StrategyChoice, devices: Sequence[jax.Device] | None = None):
    """``(mesh, seq_axes)`` for ``strategy`` over ``devices`` (default: all devices).

    ``"hybrid"`` gets a 2 x N/2 ``("dcn", "ici")`` mesh (ring across the outer
    axis, Ulysses inside the inner one); every other strategy one ``"sp"`` axis.
    """
    grid = np.array(jax.devices() if devices is None else devices)
    if strategy == "hybrid":
        if grid.size % 2:
            raise ValueError(f'strategy="hybrid" needs an even number of devices for its 2 x '
                             f"N/2 mesh. Got {grid.size}.")
        return jax.sharding.Mesh(grid.reshape(2, -1), ("dcn", "ici")), ("dcn", "ici")
    return jax.sharding.Mesh(grid, ("sp",)), "sp"


def init_params(config: ModelConfig, seed: int) -> nnx.State:
    """The model's initial parameters for ``seed`` (independent of any mesh)."""
    return nnx.state(TransformerLM(config, rngs=nnx.Rngs(seed)), nnx.Param)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clip to global norm 1, then AdamW on a linear-warmup + cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.peak_learning_rate,
        warmup_steps=min(config.warmup_steps, config.steps),
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=0.1 * config.peak_learning_rate)
    decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                    mask=decay_matrices))


def fsdp_sharding(mesh: jax.sharding.Mesh, x) -> NamedSharding:
    """ZeRO-3 / FSDP placement of one parameter (or optimizer moment) over all devices.

    Its largest dimension that the device count divides is split over every mesh
    axis; arrays with none (biases, norms, scalars) stay replicated. Inside the
    step, jit gathers each weight where it is used and reduce-scatters its gradient.
    """
    devices = mesh.devices.size
    dims = sorted(range(np.ndim(x)), key=lambda d: -np.shape(x)[d])
    for dim in dims:
        if np.shape(x)[dim] % devices == 0:
            spec: list[Optional[tuple]] = [None] * np.ndim(x)
            spec[dim] = tuple(mesh.axis_names)
            return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def next_byte_loss(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], segment_ids=batch["segment_ids"],
                   positions=batch.get("positions"),
                   bidirectional_ids=batch.get("bidirectional_ids"))  # [B, S, V]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = batch["weights"]
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    parallelism: Parallelism = Parallelism(),
    *,
    params: Optional[nnx.State] = None,
    data: Optional[PackedRows] = None,
    progress: bool = False,
    description: str = "",
) -> TrainResult:
    """Train :class:`TransformerLM` on packed standard-library bytes.

    Args:
      model_config, train_config: the model and the run.
      parallelism: mesh and attention strategy; each token batch is put into the
        strategy's layout once (:func:`jax_seqpar.permute_batch`, per_document from
        the batch's segment ids with ``parallelism.per_document``; the loss, a mean
        over tokens, does not depend on their order) and placed sequence-sharded
        (``P(None, seq_axes)``), so attention is sequence-parallel, no layer moves
        tokens, and everything else is per-token work on each shard. Parameters and
        optimizer state are replicated, or sharded with ``parallelism.fsdp``.
        ``Parallelism()`` trains unsharded.
      params: initial parameters (default: :func:`init_params` with the seed).
      data: the batches (default: :func:`training_batches` with the seed); their
        ``bidirectional_ids``, when set, go to every layer.
      progress: show a tqdm progress bar labelled ``description``.

    Returns:
      A :class:`TrainResult`. Deterministic given the configs (and params, data).

    .. code-block:: python

        mesh, axes = mesh_for("ring")
        result = train(ModelConfig(), TrainConfig(steps=20), Parallelism(mesh, axes, "ring"))
    """
    model = TransformerLM(model_config, parallelism, rngs=nnx.Rngs(train_config.seed))
    graphdef, own_params = nnx.split(model, nnx.Param)
    params = own_params if params is None else params
    if data is None:
        data = training_batches(steps=train_config.steps, batch=train_config.batch,
                                seq_len=train_config.seq_len, seed=train_config.seed)
    if data.tokens.shape[0] < train_config.steps:
        raise ValueError(f"data has {data.tokens.shape[0]} batches for "
                         f"{train_config.steps} steps.")
    optimizer = make_optimizer(train_config)
    mesh = parallelism.mesh

    def place_params(tree):
        if mesh is None:
            return jax.device_put(tree)
        if parallelism.fsdp:
            return jax.tree.map(lambda x: jax.device_put(x, fsdp_sharding(mesh, x)), tree)
        return jax.device_put(tree, NamedSharding(mesh, P()))

    def place_batch(tree):
        if mesh is None:
            return jax.device_put(tree)
        return jax.device_put(tree, NamedSharding(mesh, P(None, parallelism.seq_axes)))

    params = place_params(params)
    opt_state = place_params(optimizer.init(params))

    def batch_at(index):
        batch = {"tokens": data.tokens[index], "targets": data.targets[index],
                 "segment_ids": data.segment_ids[index], "weights": data.weights[index]}
        if data.bidirectional_ids is not None:
            batch["bidirectional_ids"] = data.bidirectional_ids[index]
        if mesh is not None:
            by_document = parallelism.layout == "per_document"
            batch, batch["positions"] = permute_batch(
                batch, parallelism.layout, parallelism.num_shards,
                segment_ids=batch["segment_ids"] if by_document else None)
        return place_batch(batch)

    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)

    # The state keeps its placement from step to step (replicated, or FSDP-sharded).
    @functools.partial(jax.jit, out_shardings=(shardings(params), shardings(opt_state), None))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(next_byte_loss, argnums=1)(graphdef, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    first = batch_at(0)
    compiled = step.lower(params, opt_state, first).compile()
    batch_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(first))
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError("the backend gives no memory analysis of the compiled step, "
                           "which state_bytes reads.")
    state_bytes = analysis.argument_size_in_bytes - batch_bytes

    steps: Iterable[int] = range(train_config.steps)
    bar = None
    if progress:
        tqdm = require("tqdm", "examples", "the progress bar").tqdm
        steps = bar = tqdm(steps, desc=description, unit="step", leave=True)
    losses, compile_seconds = [], 0.0
    for index in steps:
        params, opt_state, loss = compiled(params, opt_state, first if index == 0 else
                                           batch_at(index))
        losses.append(float(loss))  # waits for the step: honest timing
        if index == 0:
            compile_seconds = time.perf_counter() - start
            start = time.perf_counter()
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - start
    timed_tokens = (train_config.steps - 1) * train_config.batch * train_config.seq_len
    return TrainResult(losses=np.asarray(losses, np.float32), compile_seconds=compile_seconds,
                       seconds=seconds,
                       tokens_per_second=timed_tokens / seconds if timed_tokens else float("nan"),
                       state_bytes=int(state_bytes))
