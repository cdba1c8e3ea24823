"""The Pallas flash-attention kernels for TPUs (Mosaic; interpreted elsewhere):
:mod:`.mosaic` is the kernel, ``_common``/``_bwd`` its parts."""

__all__: list[str] = []
