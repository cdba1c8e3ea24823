"""Sphinx configuration of the jax_seqpar documentation.

Build (from the repository root; warnings and unresolved references are errors):

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import re
import sys

# The pages and the API reference import jax_seqpar: 8 emulated CPU devices, set before
# JAX starts (autodoc imports the package in this process; the executed pages' kernels
# inherit the environment, and set it themselves in their first cell too).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.abspath(".."))

project = "jax_seqpar"
author = "the jax_seqpar authors"
copyright = "the jax_seqpar authors"  # noqa: A001 - Sphinx's name

extensions = [
    "myst_nb",  # MyST markdown, and executes the pages that are notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings, as the package writes them
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# Executed pages: tiny shapes on 8 emulated CPU devices, a couple of seconds each.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_show_tb = True
nb_output_stderr = "remove"  # JAX's start-up logging, not the pages' output

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# No network in CI: the third-party targets are listed below instead of intersphinx
# inventories (intersphinx_mapping left empty keeps the extension's roles harmless).
intersphinx_mapping: dict = {}

nitpicky = True
# Ambiguous (not unresolved) Python references: an annotation's builtin ``bytes`` also
# matches our attributes named ``bytes`` (``Strategy.bytes``, ...), and there is no
# builtin target offline to prefer. Unresolved references stay errors.
suppress_warnings = ["ref.python"]
# Third-party names our signatures and docstrings mention. The build has no network, so
# no intersphinx inventories resolve them; each is listed exactly (no patterns), so an
# unresolved name of OUR package still fails the build.
nitpick_ignore = [
    # JAX: arrays (annotations resolve jax.Array to its jaxlib class), meshes, specs.
    ("py:class", "jax.jaxlib._jax.Array"),
    ("py:class", "jax.Array"),
    ("py:class", "jax.typing.ArrayLike"),
    ("py:class", "jax._src.typing.SupportsDType"),
    ("py:class", "jax._src.stages.Compiled"),
    ("py:class", "jax.numpy.float32"),
    ("py:class", "jaxlib._jax.Device"),
    ("py:class", "jax._src.mesh.Mesh"),
    ("py:class", "jax.sharding.Mesh"),
    ("py:class", "jax.sharding.PartitionSpec"),
    ("py:class", "jax.P"),
    ("py:class", "jax.ShapeDtypeStruct"),
    ("py:func", "jax.lax.platform_dependent"),
    ("py:func", "jax.export.export"),
    ("py:func", "jax.experimental.topologies.get_topology_desc"),
    # NumPy.
    ("py:class", "numpy.ndarray"),
    ("py:class", "np.ndarray"),  # as written where a signature's annotations stay strings
    ("py:class", "numpy.dtype"),
    ("py:class", "numpy.number"),
    ("py:class", "numpy.bool"),
    ("py:class", "numpy.random._generator.Generator"),
    # Flax (the [flax] extra) and optax (the [examples] extra).
    ("py:class", "flax.nnx.statelib.State"),
    ("py:class", "flax.nnx.module.Module"),
    ("py:class", "optax._src.base.GradientTransformation"),
    # The standard library (no Python inventory offline either).
    ("py:class", "argparse.ArgumentParser"),
    ("py:class", "argparse.Namespace"),
    ("py:class", "pathlib.Path"),
    ("py:class", "os.PathLike"),
    ("py:class", "collections.abc.Mapping"),
    ("py:class", "argparse.HelpFormatter"),
]

html_theme = "sphinx_book_theme"
html_title = "jax_seqpar"
html_theme_options = {"show_toc_level": 2}


def _join_wrapped_names(app, what, name, obj, options, lines):
    """Join a wrapped list of argument names onto one line.

    The package documents keywords that share a meaning in one entry
    (``causal, window, ...: as in ...``); when the names wrap, napoleon would read the
    first line as a field without a description. Runs before napoleon (priority 400).
    """
    i = 0
    while i < len(lines) - 1:
        if re.fullmatch(r"\s+\**\w+(, \**\w+)*,", lines[i]):
            lines[i] = f"{lines[i]} {lines.pop(i + 1).strip()}"
            continue
        i += 1


def setup(app):
    app.connect("autodoc-process-docstring", _join_wrapped_names, priority=400)
