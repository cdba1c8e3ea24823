"""The Pallas flash-attention kernels for GPUs (Triton; interpreted elsewhere):
:mod:`.pallas` is the kernel, ``_core``/``_config``/``_bwd`` its parts."""

__all__: list[str] = []
