"""The fused kernels compile for an H100 (sm_90) here, without a GPU: Triton's whole pipeline
(front end, TTGIR, LLVM, ptxas) on the production signatures, so a kernel that only the
interpreter accepts (loop-carried types, control flow) fails in the suite, not on the first GPU
run. Shared memory per kernel is printed for ``tools/gpu_check.sh``'s reader."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ultraep_megatron.planner import triton_plan, triton_reroute  # noqa: E402

PLAN = {
    "load_ptr": "*i64", "record_ptr": "*i64", "table_ptr": "*i32", "scratch_ptr": "*i32",
    "rank": "i32", "R": "i32", "E": "i32", "G": "i32", "S": "i32", "N": "i32", "floor": "i32",
    "use_trigger": "i32", "trigger_bits": "i64",
}  # fmt: skip
SCATTER = {
    "topk_ptr": "*i64", "hidden_ptr": "*bf16", "probs_ptr": "*fp32", "table_ptr": "*i32",
    "counts_ptr": "*i32", "offsets_ptr": "*i32", "out_ptr": "*bf16", "out_probs_ptr": "*fp32",
    "send_token_ptr": "*i32", "pair_slot_ptr": "*i32", "pair_row_ptr": "*i32",
    "num_pairs": "i32", "K": "i32", "E": "i32", "C": "i32", "H": "i32",
}  # fmt: skip
UNPERMUTE = {
    "grad_ptr": "*bf16", "grad_probs_ptr": "*fp32", "pair_row_ptr": "*i32",
    "grad_hidden_ptr": "*bf16", "grad_pair_probs_ptr": "*fp32", "T": "i32", "K": "i32",
    "H": "i32", "N": "i32",
}  # fmt: skip
COUNT = {"topk_ptr": "*i64", "counts_ptr": "*i32", "num_pairs": "i32", "E": "i32"}

CASES = [
    ("plan EP64 E256 S2", triton_plan._plan_kernel, PLAN,
     dict(BLOCK_R=64, BLOCK_G=4, BLOCK_E=256, BLOCK_P=8, BLOCK_RP=512, BLOCK_C=1024, EB=32)),
    ("plan EP64 E512 S4", triton_plan._plan_kernel, PLAN,
     dict(BLOCK_R=64, BLOCK_G=8, BLOCK_E=512, BLOCK_P=16, BLOCK_RP=1024, BLOCK_C=1024, EB=32)),
    ("count", triton_reroute._count_kernel, COUNT, dict(BLOCK=1024, CHUNK=256, BLOCK_E=256)),
    ("scatter", triton_reroute._scatter_kernel, SCATTER,
     dict(BLOCK=1024, SUB=64, BLOCK_E=256, BLOCK_H=128, LOG_C=9)),
    ("unpermute", triton_reroute._unpermute_kernel, UNPERMUTE,
     dict(TOKENS=16, BLOCK_K=8, BLOCK_H=64)),
]  # fmt: skip


@pytest.mark.parametrize("name,kernel,signature,constants", CASES, ids=[c[0] for c in CASES])
def test_kernel_compiles_for_sm90(name, kernel, signature, constants):
    signature = dict(signature, **{key: "constexpr" for key in constants})
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
    )
    assert "ptx" in compiled.asm and compiled.asm["cubin"]
    meta = compiled.metadata
    print(f"{name}: shared {meta.shared} bytes, {getattr(meta, 'num_warps', '?')} warps")
