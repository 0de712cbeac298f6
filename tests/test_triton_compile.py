"""The Triton kernels compile for a real GPU (sm_90, an H100/H200) on a machine without one.

The interpreter runs the kernels' Python semantics; this compiles them through Triton's whole
GPU pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) to a cubin, catching what only the GPU compiler
rejects. No driver or device is needed. ``cuobjdump -res-usage`` (shipped with Triton) reads
the registers per thread: a kernel must fit in 255 registers with at most a small spill.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attnres_dist.ops import triton_kernels as K  # noqa: E402

SCALARS = {
    "n": "i32",
    "m": "i32",
    "T": "i32",
    "D": "i32",
    "S": "i32",
    "eps": "fp32",
    "tiles": "i32",
}


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict, warps: int, tmp_path):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name) or SCALARS[name]
    src = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin = tmp_path / f"{kernel.__name__}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True)
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    assert match, usage.stdout + usage.stderr
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_sm90(dtype, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src = f"*{dtype}"
    block_s, block_t, block_d = K.tile_sizes(3, 16384, 512)
    tile = dict(BLOCK_S=block_s, BLOCK_T=block_t, BLOCK_D=block_d)
    warps = K.num_warps(block_s * block_t * block_d)
    f32 = "*fp32"
    p1 = {"blocks": src, "u": f32, "out1": f32, "lse": f32}
    usage = {
        "phase1_fwd": compile_sm90(K.phase1_fwd_kernel(), p1, tile, warps, tmp_path),
        "phase1_bwd": compile_sm90(
            K.phase1_bwd_kernel(),
            {**p1, "g_out1": f32, "g_lse": f32, "d_blocks": src, "du_part": f32},
            {**tile, "HAS_G_LSE": True, "ACCUMULATE": False},
            warps,
            tmp_path,
        ),
    }
    _, block_t, block_d = K.tile_sizes(1, 16384, 512)
    tile2 = dict(BLOCK_T=block_t, BLOCK_D=block_d)
    warps2 = K.num_warps(block_t * block_d)
    p2 = {"out1": f32, "lse": f32, "extra": src, "u": f32}
    usage["phase2_fwd"] = compile_sm90(
        K.phase2_fwd_kernel(), {**p2, "out": src, "lse_out": f32}, tile2, warps2, tmp_path
    )
    usage["phase2_bwd"] = compile_sm90(
        K.phase2_bwd_kernel(),
        {**p2, "grad_out": src, "lse_tot": f32, "d_out1": f32, "d_lse": f32, "d_extra": src,
         "du_part": f32},
        tile2,
        warps2,
        tmp_path,
    )  # fmt: skip
    for name, (regs, stack) in usage.items():
        assert regs <= 255 and stack <= 128, (name, regs, stack)
