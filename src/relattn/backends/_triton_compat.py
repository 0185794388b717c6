"""The "triton" backend's interpreter workarounds, in one place: ``dot``, ``cast`` and ``device_fn``.

Compiled for a GPU they are plain ``tl.dot``, ``x.to(dtype)`` and ``triton.jit``. Under ``TRITON_INTERPRET=1``
(Triton 3.6 and 3.9, checked) the interpreter computes two things differently from a GPU, and these versions make
it compute what a GPU computes:

* it multiplies bfloat16 ``tl.dot`` operands as their raw 16-bit integers: there they go in as float32 (exact:
  a product of two bfloat16 values is exact in float32, as on tensor cores);
* it truncates float32 -> bfloat16 (a GPU rounds to nearest even): there the rounding is done on the bits first
  (ties away from zero), so the truncation that follows is exact.

It also re-patches ``triton.language`` on every device-function call (about a millisecond, a dozen calls per
tile); the kernel calling it has patched it already, so there device functions are called directly.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_fn(fn):
    """``triton.jit`` for a device function (called directly under the interpreter: see the module docstring)."""
    jitted = triton.jit(fn)
    rewrite = getattr(jitted, "rewrite", None)
    if not INTERPRET or rewrite is None:
        return jitted
    return lambda *args, **kwargs: rewrite()(*args, **kwargs)


if INTERPRET:

    @device_fn
    def dot(a, b, PREC: tl.constexpr):
        """a @ b accumulated in float32 (float64 for float64 operands)."""
        if a.dtype == tl.bfloat16:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision=PREC)
        return out

    @device_fn
    def cast(x, dtype: tl.constexpr):
        """x rounded to ``dtype`` to nearest."""
        if (dtype == tl.bfloat16) and (x.dtype == tl.float32):
            bits = x.to(tl.uint32, bitcast=True)
            x = ((bits + 0x8000) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x.to(dtype)

else:

    @triton.jit
    def dot(a, b, PREC: tl.constexpr):
        """a @ b accumulated in float32 (float64 for float64 operands)."""
        return tl.dot(a, b, input_precision=PREC)

    @triton.jit
    def cast(x, dtype: tl.constexpr):
        """x rounded to ``dtype`` to nearest."""
        return x.to(dtype)
