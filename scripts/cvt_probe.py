"""Offline probe (no GPU): how Triton builds the conversion of a Hopper matmul accumulator to a layout with
16 contiguous bytes per thread, for the forward's output stores at head dim 128.

    TRITON_INTERPRET=0 python scripts/cvt_probe.py

Builds one small Gluon kernel for sm_90 three ways and counts instructions in its SASS (Triton's nvdisasm):
mode 0 stores the 64 x 128 accumulator directly (4-byte stores); mode 1 converts it first to a layout that
keeps each warp's own 16 rows (``BlockedLayout([8, 8], [2, 16], [4, 1])``: a conversion that could stay inside
each warp); mode 2 to the layout ``sm90_common.store_rows`` stages through shared memory. Prints the shared
memory each build needs and its shuffle, shared-memory and store instructions.
"""

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

OPS = ("SHFL", "STS", "LDS", "STG.E.128", "STG.E ", "BAR")


@gluon.jit
def _probe_kernel(out_ptr, stride, Tq, MODE: gl.constexpr):
    """A 64 x 128 float32 accumulator in a warpgroup's matmul layout, stored as bfloat16 rows below ``Tq``."""
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    rows0 = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_o))
    cols0 = gl.arange(0, 128, layout=gl.SliceLayout(0, mma_o))
    acc = (gl.expand_dims(rows0, 1) * 128 + gl.expand_dims(cols0, 0)).to(gl.float32)
    if MODE == 0:
        layout: gl.constexpr = mma_o
    elif MODE == 1:
        layout: gl.constexpr = gl.BlockedLayout([8, 8], [2, 16], [4, 1], [1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    t = gl.convert_layout(acc.to(gl.bfloat16), layout)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(rows < Tq, 1) & gl.expand_dims(cols < 128, 0)
    gl.store(out_ptr + gl.expand_dims(rows.to(gl.int64) * stride, 1) + gl.expand_dims(cols, 0), t, mask=mask)


def main():
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sig = {"out_ptr": "*bf16", "stride": "i32", "Tq": "i32", "MODE": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    for mode in (0, 1, 2):
        compiled = triton.compile(GluonASTSource(fn=_probe_kernel, signature=sig, constexprs={"MODE": mode}, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        counts = {op: sum(op in line for line in sass.splitlines()) for op in OPS}
        print(f"Triton {triton.__version__}, mode {mode}: shared memory {compiled.metadata.shared} B, "
              + ", ".join(f"{op.strip()} {n}" for op, n in counts.items()))


if __name__ == "__main__":
    main()
