"""Whether the Triton kernels are available: Triton ships with CUDA builds of PyTorch; a
CPU-only install runs the reference implementations and needs no Triton."""

try:
    from fxlora.kernels import bgmv, sgmv
except ImportError:  # no Triton installed
    bgmv = sgmv = None

__all__ = ["bgmv", "sgmv"]
