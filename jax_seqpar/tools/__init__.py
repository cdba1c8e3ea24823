"""Layer 7, ``tools``: compile-only targets and ahead-of-time compiles, reading compiled
programs (:mod:`.hlo`), benchmarks, tuning and calibration, text tables (:mod:`.report`),
and the ``jax-seqpar`` command (:mod:`.cli`)."""

__all__: list[str] = []
