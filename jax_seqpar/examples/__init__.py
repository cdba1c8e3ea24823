"""A worked example: a byte-level decoder LM trained with sequence-parallel attention.

``jax-seqpar demo`` runs :func:`run_demo`; the pieces are reusable on their own.
Needs the ``[examples]`` extra (Flax, optax, matplotlib, tqdm).
"""

from jax_seqpar.core.extras import require

for _module in ("flax", "optax"):
    require(_module, "examples", "jax_seqpar.examples (jax-seqpar demo)")

from jax_seqpar.examples._data import MASKS as MASKS
from jax_seqpar.examples._data import PackedRows as PackedRows
from jax_seqpar.examples._data import pack_documents as pack_documents
from jax_seqpar.examples._data import stdlib_documents as stdlib_documents
from jax_seqpar.examples._data import training_batches as training_batches
from jax_seqpar.examples._data import with_mask as with_mask
from jax_seqpar.examples._model import ModelConfig as ModelConfig
from jax_seqpar.examples._model import Parallelism as Parallelism
from jax_seqpar.examples._model import TransformerLM as TransformerLM
from jax_seqpar.examples._train import TrainConfig as TrainConfig
from jax_seqpar.examples._train import TrainResult as TrainResult
from jax_seqpar.examples._train import init_params as init_params
from jax_seqpar.examples._train import make_optimizer as make_optimizer
from jax_seqpar.examples._train import mesh_for as mesh_for
from jax_seqpar.examples._train import train as train
from jax_seqpar.examples._demo import DEFAULT_STRATEGIES as DEFAULT_STRATEGIES
from jax_seqpar.examples._demo import as_strategy_list as as_strategy_list
from jax_seqpar.examples._demo import run_demo as run_demo
from jax_seqpar.examples._generate_demo import run_generate as run_generate
from jax_seqpar.examples._generate import Generation as Generation
from jax_seqpar.examples._generate import generate as generate
from jax_seqpar.examples._generate import load_params as load_params
from jax_seqpar.examples._generate import save_params as save_params

__all__ = ["DEFAULT_STRATEGIES", "Generation", "MASKS", "ModelConfig", "PackedRows",
           "Parallelism", "TrainConfig", "TrainResult", "TransformerLM",
           "as_strategy_list", "generate", "init_params", "load_params",
           "make_optimizer", "mesh_for", "pack_documents", "run_demo", "run_generate",
           "save_params", "stdlib_documents", "train", "training_batches", "with_mask"]
