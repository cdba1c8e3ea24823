"""Options travel as data: no per-call option is threaded by hand through the layers.

Strategies, kernels and the pipelines receive the mask and the per-call options as
static objects (:class:`jax_seqpar.core.masks.MaskSpec`,
:class:`jax_seqpar.kernels.options.Options`, the API's frozen call description) and the
token metadata as one pytree (:class:`jax_seqpar.core.masks.Tokens`), built once from the
public keywords at the entry points. This test counts, over every ``def`` and ``lambda``
of the package (nested ones too), the functions that take each option as a parameter.
"""

import ast
import collections
import pathlib

import pytest

import jax_seqpar

#: The most functions that may take each option: the public entry points (global,
#: per-shard, jax.nn-style, inference, Flax, the reference), the one boundary that reads
#: them (``strategies.inputs.describe``), a builder or check each: 15, plus 3 since the
#: four per-shard functions each list their keywords in a real signature (one generated
#: signature stood for the four before).
LIMIT = 18
OPTIONS = ("softcap", "scale", "block_sizes", "window", "segment_ids", "kv_segment_ids",
           "kernel", "sinks", "chunk_size", "bidirectional_ids", "mask_fn",
           "max_document_shards")


def _takers() -> dict:
    root = pathlib.Path(jax_seqpar.__file__).parent
    takers = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
                for option in OPTIONS:
                    if option in names:
                        takers[option].append(
                            f"{path.relative_to(root)}:{getattr(node, 'name', '<lambda>')}")
    return takers


@pytest.mark.parametrize("option", OPTIONS)
def test_no_option_is_threaded_through_more_than_fifteen_functions(option):
    takers = _takers()[option]
    assert len(takers) <= LIMIT, (option, len(takers), takers)
