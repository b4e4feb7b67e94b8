"""Tiling shared by the Pallas and Triton kernels of the taco group math."""

from __future__ import annotations


def wht_chunk(g: int) -> int:
    """Columns of the [G, G] Hadamard matrix per matmul: keeps a [G, chunk] float32 tile <= 64 KiB
    (the Triton register / shared-memory budget at G = 512)."""
    return min(g, 32 if g >= 256 else 64)
