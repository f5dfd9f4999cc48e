"""One PTX instruction (or block) as a value of the CuTe DSL: `ptx_value` wraps LLVM inline asm
without side effects, so the compiler may move or drop it like any arithmetic."""

from cutlass._mlir.dialects import llvm


def ptx_value(result_type, operands, asm: str, constraints: str, *, loc=None, ip=None):
    """The result (``result_type``, e.g. ``T.i32()``) of ``asm`` on ``operands`` (DSL scalars,
    ``$1`` on; ``$0`` the result) under ``constraints`` (``"=r,r,r"``); call from a ``dsl_user_op``
    and pass its loc / ip."""
    return llvm.inline_asm(
        result_type,
        [value.ir_value(loc=loc, ip=ip) for value in operands],
        asm,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
