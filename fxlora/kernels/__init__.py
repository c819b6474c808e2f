"""The Triton kernels and their launchers, one kernel family a file: ``sgmv`` (segmented
shrink and expand), ``bgmv`` (per-token expand), ``slot_sort`` (batch info in one launch) and
``decode_attention`` (over a KV cache contiguous per row, or paged); their launch parameters
per device and shape class in ``launch_table``. Nothing here knows the ``fxlora::`` ops that
call them (:mod:`fxlora.ops`). Triton ships with CUDA builds of PyTorch; a CPU-only install
runs the ops' reference implementations and needs no Triton: then the kernel modules here
are None."""

try:
    from fxlora.kernels import bgmv, decode_attention, sgmv, slot_sort
except ImportError:  # no Triton installed
    bgmv = decode_attention = sgmv = slot_sort = None

__all__ = ["bgmv", "decode_attention", "sgmv", "slot_sort"]
