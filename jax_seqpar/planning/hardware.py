"""What a device and its links can do: the constants of the planner's time model.

A :class:`Hardware` holds one chip's dense bf16 peak, its HBM, and two link
classes of the alpha-beta model ``seconds = latency + bytes / bandwidth``:
``ici`` inside one fast domain (an NVLink/NVSwitch node, a TPU ICI slice) and
``dcn`` between domains (InfiniBand, the data-center network). A mesh axis is
fast when its devices fit in one domain of ``devices_per_domain`` devices, slow
otherwise (:meth:`Hardware.link`).

Presets (:data:`PRESETS`, :func:`get`) take the vendors' figures, named in each
docstring below; the attention efficiency and the latencies are estimates, not
vendor figures. The ``"cpu"`` preset describes emulated devices
(``--xla_force_host_platform_device_count``) sharing one host: its figures are
placeholders until :func:`jax_seqpar.tools.calibrate.calibrate_cpu` measures them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["COLLECTIVES", "GPU_OVERLAPS", "Hardware", "Link", "PRESETS", "TPU_OVERLAPS",
           "for_device_kind", "get"]


#: The collective kinds the time model knows (HLO op names, as :mod:`jax_seqpar.tools.hlo`
#: reads them from a compiled program).
COLLECTIVES = ("collective-permute", "all-to-all", "all-gather", "reduce-scatter")

#: The collectives that overlap a kernel on GPU, all of them (XLA's GPU compiler runs
#: every collective asynchronously; its latency-hiding scheduler places the start before
#: an independent kernel and the done after it).
GPU_OVERLAPS = COLLECTIVES

#: The collectives that overlap a kernel on TPU. XLA's TPU compiler overlaps
#: collective-permutes with a kernel; all-to-all and all-gather only when compiled with
#: :data:`jax_seqpar.tools.targets.COMPILE_OPTIONS` (the library's target compile sets
#: each strategy's; pass them to your own ``jit`` too; Ulysses' exchange pipelined over
#: head groups, rather than sequence pieces, needs
#: :data:`jax_seqpar.tools.targets.TPU_HEAD_GROUP_OPTIONS` besides, which the model does
#: not tell apart); a reduce-scatter over a slice compiles to a synchronous all-reduce
#: and a slice, with or without them.
TPU_OVERLAPS = ("collective-permute", "all-to-all", "all-gather")


@dataclasses.dataclass(frozen=True)
class Link:
    """One link class of the alpha-beta model.

    Attributes:
      bandwidth: bytes per second ONE device sends to a neighbour over this
        link, one direction (``ppermute``).
      latency: seconds per communication step (launch + hop).
      all_to_all_bandwidth: bytes per second one device sends in an
        ``all_to_all`` / ``all_gather`` (several destinations at once, both
        directions of a torus); None means ``bandwidth``.
    """

    bandwidth: float
    latency: float
    all_to_all_bandwidth: Optional[float] = None

    def __post_init__(self):
        for name in ("bandwidth", "latency", "all_to_all_bandwidth"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and value < float("inf")):
                raise ValueError(f"Link.{name} must be a finite number >= 0. Got {value!r}.")
        if self.bandwidth <= 0 or (self.all_to_all_bandwidth or 1) <= 0:
            raise ValueError(f"Link bandwidths must be positive. Got {self!r}.")

    @property
    def collective_bandwidth(self) -> float:
        return self.bandwidth if self.all_to_all_bandwidth is None else self.all_to_all_bandwidth

    def seconds(self, num_bytes: float, steps: int = 1, *, collective: bool = False) -> float:
        """``steps * latency + num_bytes / bandwidth`` (the collective bandwidth if asked)."""
        bandwidth = self.collective_bandwidth if collective else self.bandwidth
        return steps * self.latency + num_bytes / bandwidth


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip type and its interconnect, as the planner's time model sees them.

    Attributes:
      name: the preset name (part of the tuning cache key).
      peak_flops: dense bf16 FLOP/s of one device.
      hbm_bytes: memory of one device (the default memory budget).
      hbm_bandwidth: bytes/s of that memory.
      ici: the fast link, between devices of one domain.
      dcn: the slow link, between domains.
      devices_per_domain: devices one ``ici`` domain holds (GPUs per NVLink
        node, chips per TPU slice).
      attention_efficiency: the fraction of ``peak_flops`` a flash-attention
        kernel sustains, forward and backward together (an estimate).
      overlaps: the collective kinds (HLO names: ``"collective-permute"``,
        ``"all-to-all"``, ``"all-gather"``, ``"reduce-scatter"``) whose transfer runs
        while a kernel computes in the target's compiled programs, when the program
        gives it a kernel to hide behind (:data:`GPU_OVERLAPS`, :data:`TPU_OVERLAPS`;
        the compile gate checks both against the compiled schedules). Emulated CPU
        devices copy on the cores that compute: the ``"cpu"`` preset overlaps none.
      split_backward: whether the platform's backward kernel is two kernels, dq and
        dK/dV, that each recompute the scores and ``dP`` (Pallas on GPU, Mosaic on TPU):
        a call that reads all three runs both; False: one fused loop that shares them (the
        XLA kernel, the ``"cpu"`` preset's). Read by :mod:`jax_seqpar.planning.compute`
        to price the pipelines' dq-only and dK/dV-only calls against a whole call.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    ici: Link
    dcn: Link
    devices_per_domain: int
    attention_efficiency: float = 0.5
    overlaps: tuple = COLLECTIVES
    split_backward: bool = True

    def __post_init__(self):
        for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"Hardware.{name} must be a positive finite number. "
                                 f"Got {name}={value!r}.")
        if not 0 < self.attention_efficiency <= 1:
            raise ValueError(f"attention_efficiency must be in (0, 1]. Got "
                             f"{self.attention_efficiency!r}.")
        if not isinstance(self.devices_per_domain, int) or self.devices_per_domain < 1:
            raise ValueError(f"devices_per_domain must be a positive int. Got "
                             f"{self.devices_per_domain!r}.")
        unknown = set(self.overlaps) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"Hardware.overlaps names collective kinds {sorted(unknown)} "
                             f"that are not among {list(COLLECTIVES)}.")

    @property
    def overlap(self) -> bool:
        """Whether any transfer runs while the device computes."""
        return bool(self.overlaps)

    @property
    def attention_flops(self) -> float:
        """FLOP/s an attention kernel sustains on one device."""
        return self.peak_flops * self.attention_efficiency

    def link(self, size: int, stride: int = 1) -> Link:
        """The link a collective over ``size`` devices, ``stride`` apart, waits on.

        Mesh devices are numbered inner axis fastest, so an axis of ``size``
        whose inner axes hold ``stride`` devices spans ``size * stride``
        consecutive devices: within one domain its every hop is fast, across
        domains its slowest hop (a ring step, the remote part of an
        all-to-all) is on the slow link.
        """
        return self.ici if size * stride <= self.devices_per_domain else self.dcn

    def replace(self, **changes: Any) -> "Hardware":
        """A copy with ``changes`` (e.g. ``devices_per_domain=4``)."""
        return dataclasses.replace(self, **changes)


_GB = 1e9
_GIB = 2.0**30

#: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): 989 TFLOP/s dense BF16
#: (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s per GPU
#: (both directions: 450 GB/s each way through NVSwitch to any GPU of the
#: node). DGX H100: eight ConnectX-7 NICs, 400 Gb/s InfiniBand NDR per GPU
#: (50 GB/s). Latencies ~3 us (NVLink) and ~10 us (IB) per NCCL step: estimates.
H100 = Hardware(name="h100", peak_flops=989e12, hbm_bytes=80 * _GB, hbm_bandwidth=3.35e12,
                ici=Link(450 * _GB, 3e-6), dcn=Link(50 * _GB, 10e-6), devices_per_domain=8,
                overlaps=GPU_OVERLAPS)

#: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 989 TFLOP/s dense BF16,
#: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s per GPU; DGX H200 (ConnectX-7,
#: 400 Gb/s NDR per GPU). Links as :data:`H100`.
H200 = H100.replace(name="h200", hbm_bytes=141 * _GB, hbm_bandwidth=4.8e12)

#: NVIDIA A100 Tensor Core GPU datasheet (A100 SXM 80GB): 312 TFLOP/s dense
#: BF16, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s per GPU (300 GB/s each
#: way); DGX A100: eight ConnectX-6 NICs, 200 Gb/s InfiniBand HDR per GPU
#: (25 GB/s).
A100 = Hardware(name="a100", peak_flops=312e12, hbm_bytes=80 * _GB, hbm_bandwidth=2.039e12,
                ici=Link(300 * _GB, 3e-6), dcn=Link(25 * _GB, 10e-6), devices_per_domain=8,
                overlaps=GPU_OVERLAPS)


def _tpu_ici(bidirectional_per_chip: float, ports: int) -> Link:
    """A 1-D mesh axis on a torus ring: a ``ppermute`` uses one port one way,
    an all-to-all both ways of the ring; ~2 us per step (estimate)."""
    one_way = bidirectional_per_chip / ports / 2
    return Link(one_way, 2e-6, all_to_all_bandwidth=2 * one_way)


#: Cloud TPU v5e system architecture (Google Cloud TPU documentation): 197
#: TFLOP/s BF16, 16 GB HBM2 at 819 GB/s, 400 GB/s bidirectional ICI per chip
#: over 4 ports (2-D torus), 256-chip pods; DCN 6.4 Tb/s per pod = 25 Gb/s
#: (3.125 GB/s) per chip (2 x 100 Gb/s NICs per 8-chip host).
TPU_V5E = Hardware(name="tpu-v5e", peak_flops=197e12, hbm_bytes=16 * _GB,
                   hbm_bandwidth=819 * _GB, ici=_tpu_ici(400 * _GB, 4),
                   dcn=Link(3.125 * _GB, 20e-6), devices_per_domain=256,
                   overlaps=TPU_OVERLAPS)

#: Cloud TPU v5p system architecture (Google Cloud TPU documentation): 459
#: TFLOP/s BF16, 95 GiB HBM2e at 2,765 GB/s, 1,200 GB/s bidirectional ICI per
#: chip (4,800 Gb/s over 6 ports, 3-D torus), slices up to 6,144 chips; DCN
#: 50 Gb/s (6.25 GB/s) per chip.
TPU_V5P = Hardware(name="tpu-v5p", peak_flops=459e12, hbm_bytes=95 * _GIB,
                   hbm_bandwidth=2765 * _GB, ici=_tpu_ici(1200 * _GB, 6),
                   dcn=Link(6.25 * _GB, 20e-6), devices_per_domain=6144,
                   overlaps=TPU_OVERLAPS)

#: Cloud TPU v6e (Trillium) system architecture (Google Cloud TPU
#: documentation): 918 TFLOP/s BF16, 32 GB HBM at 1,638 GB/s, 800 GB/s
#: bidirectional ICI per chip over 4 ports (2-D torus), 256-chip pods. The page
#: gives no DCN figure: v5e's 25 Gb/s per chip is assumed.
TPU_V6E = Hardware(name="tpu-v6e", peak_flops=918e12, hbm_bytes=32 * _GB,
                   hbm_bandwidth=1638 * _GB, ici=_tpu_ici(800 * _GB, 4),
                   dcn=Link(3.125 * _GB, 20e-6), devices_per_domain=256,
                   overlaps=TPU_OVERLAPS)

#: Emulated CPU devices of one host: placeholders of the right order for a
#: few-core host (measure them with :func:`jax_seqpar.tools.calibrate.calibrate_cpu`).
#: Every device is in one domain; copies do not overlap compute.
CPU = Hardware(name="cpu", peak_flops=20e9, hbm_bytes=4 * _GIB, hbm_bandwidth=10 * _GB,
               ici=Link(2 * _GB, 50e-6), dcn=Link(2 * _GB, 50e-6), devices_per_domain=1 << 20,
               attention_efficiency=0.3, overlaps=(), split_backward=False)

#: Every preset by name.
PRESETS = {h.name: h for h in (H100, H200, A100, TPU_V5E, TPU_V5P, TPU_V6E, CPU)}

# Substrings of ``jax.Device.device_kind`` -> preset (checked in order).
_DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v5 lite", "tpu-v5e"),
                 ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v5", "tpu-v5p"),
                 ("v6", "tpu-v6e"), ("cpu", "cpu"))


def get(hardware: Hardware | str | None) -> Hardware:
    """A :class:`Hardware` from a preset name (``"h100"``, ``"tpu-v5p"``, ...) or itself."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.lower() in PRESETS:
        return PRESETS[hardware.lower()]
    raise ValueError(f"hardware={hardware!r} is not a Hardware or one of the presets "
                     f"{sorted(PRESETS)}.")


def for_device_kind(device_kind: str) -> Optional[Hardware]:
    """The preset for a ``jax.Device.device_kind`` (``"NVIDIA H100 80GB HBM3"``,
    ``"TPU v5 lite"``, ``"cpu"``), or None when no preset describes it."""
    kind = device_kind.lower()
    for needle, name in _DEVICE_KINDS:
        if needle in kind:
            return PRESETS[name]
    return None
