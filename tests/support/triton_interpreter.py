"""Three bugs of triton 3.6's interpreter (TRITON_INTERPRET=1: kernels run with numpy on the CPU),
patched outside the kernels under test so that the interpreter computes what a GPU computes.
Used by the Triton tests and by `benchmarks/gpu_check.py --smoke`.

- numpy >= 2.4 refuses int() of a 1-element 1-d array, which is how the interpreter holds
  scalars, so `range(start, stop)` with runtime bounds fails (triton#9171, fixed after 3.6).
- `tl.dot` of bfloat16 multiplies the raw uint16 bit patterns the interpreter stores bf16 as
  (triton#11584); widen them to float32 first (exact, as the GPU's MMA products are).
- float32 -> bfloat16 casts truncate the mantissa; a GPU (and torch) rounds to nearest even.
"""

from __future__ import annotations


def patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "kvflow_patched", False):
        return
    interpreter.kvflow_patched = True
    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot
    cast = interpreter.InterpreterBuilder.cast_impl

    def _patch_lang_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def _create_dot(self, a, b, *args):
        return create_dot(self, _widen(a), _widen(b), *args)

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    interpreter._patch_lang_tensor = _patch_lang_tensor
    interpreter.InterpreterBuilder.create_dot = _create_dot
    interpreter.InterpreterBuilder.cast_impl = _cast_impl
