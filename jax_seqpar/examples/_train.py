"""Training loop: AdamW with warmup + cosine decay, sequence sharded over a mesh."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

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
    """

    losses: np.ndarray
    compile_seconds: float
    seconds: float
    tokens_per_second: float


def mesh_for(strategy: str, devices=None):
    """``(mesh, seq_axes)`` for ``strategy`` over ``devices`` (default: all devices).

    ``"hybrid"`` gets a 2 x N/2 ``("dcn", "ici")`` mesh (ring across the outer
    axis, Ulysses inside the inner one); every other strategy one ``"sp"`` axis.
    """
    devices = np.array(jax.devices() if devices is None else devices)
    if strategy == "hybrid":
        if devices.size % 2:
            raise ValueError(f'strategy="hybrid" needs an even number of devices for its 2 x '
                             f"N/2 mesh. Got {devices.size}.")
        return jax.sharding.Mesh(devices.reshape(2, -1), ("dcn", "ici")), ("dcn", "ici")
    return jax.sharding.Mesh(devices, ("sp",)), "sp"


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


def _loss(graphdef, params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], segment_ids=batch["segment_ids"])  # [B, S, V]
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
      parallelism: mesh and attention strategy; the token batches are placed
        sequence-sharded (``P(None, seq_axes)``) on the mesh and the parameters
        replicated, so attention is sequence-parallel and everything else is
        per-token work on each shard. ``Parallelism()`` trains unsharded.
      params: initial parameters (default: :func:`init_params` with the seed).
      data: the batches (default: :func:`training_batches` with the seed).
      progress: show a tqdm progress bar labelled ``description``.

    Returns:
      A :class:`TrainResult`. Deterministic given the configs (and params, data).

    >>> mesh, axes = mesh_for("ring")
    >>> result = train(ModelConfig(), TrainConfig(steps=20), Parallelism(mesh, axes, "ring"))
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
    if parallelism.mesh is None:
        place_params = place_batch = jax.device_put
    else:
        replicated = NamedSharding(parallelism.mesh, P())
        seq_sharded = NamedSharding(parallelism.mesh, P(None, parallelism.seq_axes))
        place_params = lambda tree: jax.device_put(tree, replicated)
        place_batch = lambda tree: jax.device_put(tree, seq_sharded)
    params = place_params(params)
    opt_state = place_params(optimizer.init(params))

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    steps = range(train_config.steps)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=description, unit="step", leave=True)
    losses, start, compile_seconds = [], time.perf_counter(), 0.0
    for index in steps:
        batch = place_batch({"tokens": data.tokens[index], "targets": data.targets[index],
                             "segment_ids": data.segment_ids[index],
                             "weights": data.weights[index]})
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))  # waits for the step: honest timing
        if index == 0:
            compile_seconds = time.perf_counter() - start
            start = time.perf_counter()
        if progress:
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - start
    timed_tokens = (train_config.steps - 1) * train_config.batch * train_config.seq_len
    return TrainResult(losses=np.asarray(losses, np.float32), compile_seconds=compile_seconds,
                       seconds=seconds,
                       tokens_per_second=timed_tokens / seconds if timed_tokens else float("nan"))
