"""jax_seqpar: sequence (context) parallel exact attention for JAX."""
