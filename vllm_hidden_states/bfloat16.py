# SPDX-License-Identifier: Apache-2.0
"""bfloat16 in numpy, which has no bfloat16 dtype: as ``uint16`` bit patterns.

bfloat16 is the upper half of a float32, so widening is exact (shift the 16
bits to the top of a 32-bit word) and narrowing is float32 rounded to nearest
even on its lower 16 bits. numpy only (the client imports this; no torch).
"""

import numpy as np


def widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``, any shape, any byte order) ->
    ``float32`` of the same shape, exact."""
    wide = np.empty(bits.shape, dtype=np.uint32)
    np.left_shift(bits, 16, out=wide, dtype=np.uint32)
    return wide.view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """``float32`` -> bfloat16 bit patterns (``uint16``), rounded to nearest
    even, as torch's ``.to(torch.bfloat16)`` rounds (finite values)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)
