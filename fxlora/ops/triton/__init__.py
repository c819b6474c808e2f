"""Whether the Triton kernels are available: Triton ships with CUDA builds of PyTorch; a
CPU-only install runs the reference implementations and needs no Triton."""

try:
    from fxlora.ops.triton import bgmv, sgmv, slot_sort
except ImportError:  # no Triton installed
    bgmv = sgmv = slot_sort = None

__all__ = ["bgmv", "sgmv", "slot_sort"]
