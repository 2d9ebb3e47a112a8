"""Fused Triton kernels for the decoder layer, each with the layers' torch code as its reference.

`dispatch` decides per call whether the layers use them (no triton import); the kernel modules import
triton and are imported only on that path.
"""
