"""Build every GPU launch of flashrange for Hopper (sm_90) without a GPU; run by tests/test_compile_sm90.py.

    TRITON_INTERPRET=0 python tests/sm90_builds.py     (prints one line per build; exit 1 if any failed)

The launchers are called on CPU tensors with their ``launch`` stood in for: each
records the kernel, its argument list and its warps and stages instead of
running it. The arguments become a Triton signature (tensors by dtype, ints
by width, the constexprs by value) with the divisibility hints Triton's JIT
would give them (so masked loads and stores vectorize as on the GPU, and the
registers reported are the GPU build's), and Triton's compiler builds it for an
sm_90 target down to a cubin, with the ptxas it ships. So what the H200
alone runs (TMA descriptors, the warp-specialized loop, the real tile sizes,
the plan kernels) is built in CI. Each line gives the build's shared memory
and, where Triton ships cuobjdump, its registers and stack (where spilled
registers go): a register-pressure check without a GPU, for the installed
Triton. Exit 3: this Triton cannot build for CUDA here (no ptxas, no CUDA
backend), nothing was tried.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

# The most shared memory one block can have on sm_90 (227 KiB, with the opt-in that Triton's launcher makes).
SM90_MAX_SHARED = 232448

_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
          torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8"}


def _signature(kernel, args):
    sig, consts = {}, {}
    for p, a in zip(kernel.params, args, strict=True):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = a
        elif isinstance(a, torch.Tensor):
            sig[p.name] = _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[p.name] = "i1"
        elif isinstance(a, int):
            sig[p.name] = "i32" if -(2**31) <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no Triton type for argument {p.name} ({type(a).__name__})")
    return sig, consts


def _attrs(kernel, args):
    """The divisibility hints Triton's JIT gives a launch's arguments: 16 for pointers on a 16-byte boundary
    and for integers that are multiples of 16 (unless the kernel says not to specialize them). Builds with
    them are the ones the GPU runs (masked loads and stores vectorize on them), so their registers and stack
    are the GPU's."""
    attrs = {}
    for i, (p, a) in enumerate(zip(kernel.params, args, strict=True)):
        if p.is_constexpr or isinstance(a, bool):
            continue
        if isinstance(a, torch.Tensor):
            aligned = a.device.type == "meta" or a.data_ptr() % 16 == 0
        elif isinstance(a, int):
            aligned = a % 16 == 0 and not p.do_not_specialize
        else:
            aligned = False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


class _Recorder:
    """Stands in for ``kernels.common.launch``: keeps ``(kernel, args, num_warps, num_stages)``."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel, grid, args, num_warps=4, num_stages=None, maxnreg=None):
        self.launches.append((kernel, tuple(args), num_warps, num_stages, maxnreg))


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _docs(T, n):
    b = [T * i // n for i in range(n + 1)]
    return [(b[i], b[i + 1], b[i], b[i + 1], 1) for i in range(n)]


def _qkv(T, Hq, D, Dv, dtype, int64):
    """Inputs with 2 key/value heads; with ``int64``, q is a view into a fused buffer whose element offsets
    pass 2**31 (a meta tensor: never allocated, only its shape and strides matter)."""
    if int64:
        q = torch.empty_strided((T, Hq, D), (2**23, D, 1), dtype=dtype, device="meta")
    else:
        q = torch.empty(T, Hq, D, dtype=dtype)
    return q, torch.empty(T, 2, D, dtype=dtype), torch.empty(T, 2, Dv, dtype=dtype)


def forward_builds():
    """``(name, recorder)`` of the forward: default configs per head dim, TMA one- and multi-slice, softcap and
    max logits, the warp-specialized config, 64-bit offsets, fp32."""
    from flashrange import plan_mask
    from flashrange.kernels import forward as fwd

    # The configs an sm_90 GPU would pick: this machine has none, so say that TMA is there.
    fwd._has_tma = lambda: True
    out = []
    cases = [
        # name, D, Dv, dtype, config (None: default), rows, softcap, max logits, int64 view
        ("d128-bf16-one-slice", 128, 128, torch.bfloat16, None, [(0, 300, 0, 300, 1)], 0.0, False, False),
        ("d128-bf16-documents-softcap-maxlogits", 128, 128, torch.bfloat16, None, _docs(300, 3), 30.0, True, False),
        ("d64-fp16-documents", 64, 64, torch.float16, None, _docs(300, 3), 0.0, False, False),
        ("d256-bf16", 256, 256, torch.bfloat16, None, _docs(300, 2), 0.0, False, False),
        ("d64-dv512-bf16", 64, 512, torch.bfloat16, None, _docs(300, 2), 0.0, False, False),
        ("d192-dv128-bf16", 192, 128, torch.bfloat16, None, _docs(300, 2), 0.0, False, False),
        ("d128-fp32", 128, 128, torch.float32, None, _docs(300, 2), 0.0, False, False),
        ("d128-bf16-int64-view", 128, 128, torch.bfloat16, None, _docs(300, 2), 0.0, False, True),
    ]
    # The Hopper kernel (Gluon), as the H200 runs it by default for 2-byte dtypes and head dims 64 and 128.
    cases += [
        ("d128-bf16-one-slice-gluon", 128, 128, torch.bfloat16, "sm90ws_m128_n128_w4_s2", [(0, 300, 0, 300, 1)],
         0.0, False, False),
        ("d64-dv128-fp16-gluon", 64, 128, torch.float16, "sm90ws_m128_n64_w4_s3", _docs(300, 2), 0.0, False,
         False),
        ("d128-bf16-int64-view-gluon", 128, 128, torch.bfloat16, "sm90ws_m128_n128_w4_s2", _docs(300, 2), 0.0,
         False, True),
        ("d128-bf16-documents-softcap-maxlogits-gluon", 128, 128, torch.bfloat16, "sm90ws_m128_n128_w4_s2",
         _docs(300, 3), 30.0, True, False),
        ("d64-dv128-bf16-gluon-merged-tiles", 64, 128, torch.bfloat16, "sm90pppm_m128_n128_w4_s3", _docs(300, 9),
         0.0, False, False),
        ("d64-fp16-one-slice-gluon", 64, 64, torch.float16, "sm90pp_m128_n128_w4_s3", [(0, 300, 0, 300, 1)],
         0.0, False, False),
        ("d128-bf16-documents-softcap-gluon-pingpong", 128, 128, torch.bfloat16, "sm90pp_m128_n128_w4_s3",
         _docs(300, 3), 30.0, True, False),
        ("d128-bf16-documents-softcap-gluon-persistent", 128, 128, torch.bfloat16, "sm90ppp_m128_n128_w4_s3",
         _docs(300, 3), 30.0, True, False),
        ("d128-bf16-documents-gluon-merged-tiles", 128, 128, torch.bfloat16, "sm90pppm_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d64-bf16-documents-softcap-gluon-merged-tiles", 64, 64, torch.bfloat16, "sm90pppm_m128_n128_w4_s3",
         _docs(300, 9), 30.0, False, False),
        ("d128-bf16-documents-gluon-dynamic", 128, 128, torch.bfloat16, "sm90pppmd_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d64-bf16-documents-softcap-maxlogits-gluon-dynamic", 64, 64, torch.bfloat16, "sm90pppmd_m128_n128_w4_s3",
         _docs(300, 9), 30.0, True, False),
        # The adaptive schedule (the counter's order or the fixed share's, chosen on the device from the plan).
        ("d128-bf16-documents-gluon-adaptive", 128, 128, torch.bfloat16, "sm90pppma_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d64-fp16-documents-softcap-maxlogits-gluon-adaptive", 64, 64, torch.float16, "sm90pppma_m128_n128_w4_s3",
         _docs(300, 9), 30.0, True, False),
        # Edge tiles masked by one key interval per row (merged tiles: per-row bounds as columns).
        ("d64-bf16-documents-gluon-adaptive-row-intervals", 64, 64, torch.bfloat16, "sm90pppmar_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d128-bf16-documents-softcap-maxlogits-gluon-adaptive-split-kv-row-intervals", 128, 128, torch.bfloat16,
         "sm90pppmakr_m128_n128_w4_s2", _docs(300, 9), 30.0, True, False),
        # A quarter or half of the probabilities' exponentials by the polynomial (softcap: its own exponential
        # stays on MUFU).
        ("d64-bf16-documents-gluon-adaptive-poly-quarter", 64, 64, torch.bfloat16, "sm90pppmax1_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d64-fp16-documents-softcap-maxlogits-gluon-adaptive-poly-half", 64, 64, torch.float16,
         "sm90pppmax2_m128_n128_w4_s3", _docs(300, 9), 30.0, True, False),
        ("d128-bf16-documents-gluon-adaptive-poly-quarter", 128, 128, torch.bfloat16, "sm90pppmax1_m128_n128_w4_s3",
         _docs(300, 9), 0.0, False, False),
        ("d128-bf16-documents-gluon-adaptive-split-kv", 128, 128, torch.bfloat16, "sm90pppmak_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, False),
        # Split key and value barriers: two slots (the 16-byte output stores at head dim 128 then fit) and three,
        # packed heads and per-head descriptors (a padded view), softcap and row maxima.
        ("d128-bf16-documents-gluon-split-kv-two-slots", 128, 128, torch.bfloat16, "sm90pppmk_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, False),
        ("d128-bf16-documents-softcap-maxlogits-gluon-split-kv", 128, 128, torch.bfloat16,
         "sm90pppmk_m128_n128_w4_s3", _docs(300, 9), 30.0, True, False),
        ("d64-fp16-documents-gluon-split-kv-two-slots", 64, 64, torch.float16, "sm90pppmk_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, False),
        ("d128-bf16-int64-view-gluon-split-kv-two-slots", 128, 128, torch.bfloat16, "sm90pppmk_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, True),
        # And two query blocks used by turns (per-head query descriptors wait for the previous item's).
        ("d128-bf16-documents-softcap-maxlogits-gluon-two-query-blocks", 128, 128, torch.bfloat16,
         "sm90pppmkq_m128_n128_w4_s2", _docs(300, 9), 30.0, True, False),
        ("d128-bf16-int64-view-gluon-two-query-blocks", 128, 128, torch.bfloat16, "sm90pppmkq_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, True),
        ("d64-fp16-documents-gluon-two-query-blocks", 64, 64, torch.float16, "sm90pppmkq_m128_n128_w4_s2",
         _docs(300, 9), 0.0, False, False),
        # The Triton kernel's merged tiles on the TMA path (on the GPU only an explicit config merges there).
        ("d64-fp16-documents-merged-tiles", 64, 64, torch.float16,
         dataclasses.replace(fwd._BY_NAME["tma_m128_n64_w4_s3"], merge=True), _docs(300, 9), 0.0, False, False),
    ]
    if fwd._has_warp_spec():
        cases.append(("d128-bf16-warp-specialized", 128, 128, torch.bfloat16, "ws_m128_n128_w8_s2",
                      _docs(300, 3), 0.0, False, False))
    for name, D, Dv, dtype, cfg_name, rows, softcap, max_logits, int64 in cases:
        T, Hq = 300, 4
        q, k, v = _qkv(T, Hq, D, Dv, dtype, int64)
        qr, kr, mt = _ranges(rows)
        plan = plan_mask(qr, kr, mt, T, T)
        if cfg_name:
            config = cfg_name if isinstance(cfg_name, fwd.FwdConfig) else fwd._BY_NAME[cfg_name]
        else:
            config = fwd._default_config.__wrapped__(D, Dv, dtype, "cuda", False, -1)
        o = torch.empty(T, Hq, Dv, dtype=dtype)
        lse = torch.empty(T, Hq)
        rowmax = torch.empty(T, Hq) if max_logits else None
        rec = _Recorder()
        fwd.launch = rec
        fwd._launch(q, k, v, o, lse, rowmax, plan, D ** -0.5, softcap, config, fwd.plan_split(config.BLOCK_M),
                    config.use_tma, False, None)
        out.append((f"forward {name} [{config.name}{', merged tiles' if config.merge else ''}]", rec))
    return out


def backward_builds():
    """``(name, recorder)`` of the backward (dQ and dK/dV kernels): the GPU default config per head dims and dtype,
    with softcap and a gradient through lse, and a 64-bit view."""
    from flashrange import plan_mask
    from flashrange.kernels import backward as bwd
    from flashrange.kernels import backward_fused as bwd_fused

    out = []
    cases = [
        ("d128-bf16", 128, 128, torch.bfloat16, 0.0, False, False),
        ("d128-bf16-softcap-dlse", 128, 128, torch.bfloat16, 30.0, True, False),
        ("d64-fp16", 64, 64, torch.float16, 0.0, False, False),
        ("d256-bf16", 256, 256, torch.bfloat16, 0.0, False, False),
        ("d64-dv512-bf16", 64, 512, torch.bfloat16, 0.0, False, False),
        ("d192-dv128-bf16", 192, 128, torch.bfloat16, 0.0, False, False),
        ("d128-fp32", 128, 128, torch.float32, 0.0, False, False),
        ("d128-bf16-int64-view", 128, 128, torch.bfloat16, 0.0, False, True),
        # The Hopper kernels (Gluon), the default there for 2-byte dtypes padded to head dim 128.
        ("d128-bf16-gluon", 128, 128, torch.bfloat16, 0.0, False, False),
        ("d128-bf16-softcap-dlse-gluon", 128, 128, torch.bfloat16, 30.0, True, False),
        ("d96-fp16-gluon", 96, 96, torch.float16, 0.0, False, False),
        ("d64-dv128-bf16-gluon", 64, 128, torch.bfloat16, 0.0, False, False),
        ("d128-dv64-bf16-gluon", 128, 64, torch.bfloat16, 0.0, False, False),
        ("d64-bf16-softcap-gluon", 64, 64, torch.bfloat16, 30.0, False, False),
        ("d64-bf16-gluon", 64, 64, torch.bfloat16, 0.0, False, False),
    ]
    # The opt-in backward that accumulates dQ in its key-major kernel (Triton; kernels/backward_fused.py), in
    # shapes whose builds spill little (72 and 0 bytes of stack with Triton 3.9).
    cases += [("d128-bf16-fused", 128, 128, torch.bfloat16, 0.0, True, False,
               bwd.BwdConfig(32, 64, 8, 2, 64, 64, 4, 2, fused_dq=True)),
              ("d64-bf16-softcap-fused", 64, 64, torch.bfloat16, 20.0, False, False,
               bwd.BwdConfig(64, 128, 8, 2, 64, 64, 4, 2, fused_dq=True))]
    # The Hopper kernels with a GQA group's query heads split in two for dK/dV (float32 partial dK/dV).
    cases += [("d128-bf16-split-heads-gluon", 128, 128, torch.bfloat16, 0.0, False, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             kv_head_chunks=2))]
    # The Hopper kernels on a dynamic schedule (items taken from a counter).
    cases += [("d128-bf16-softcap-dlse-dynamic-gluon", 128, 128, torch.bfloat16, 30.0, True, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             dynamic=True)),
              ("d64-bf16-dynamic-gluon", 64, 64, torch.bfloat16, 0.0, False, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 128, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             dynamic=True))]
    # ... and on the adaptive one (the counter or the fixed share, chosen per launch from the plan).
    cases += [("d128-bf16-adaptive-gluon", 128, 128, torch.bfloat16, 0.0, False, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             dynamic=True, adaptive=True)),
              ("d64-fp16-softcap-dlse-adaptive-gluon", 64, 64, torch.float16, 20.0, True, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 128, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             dynamic=True, adaptive=True))]
    # ... and with edge tiles masked by one interval per row or key: dK/dV held by rows (head dims 64 and 128)
    # and by keys (head dim 96 padded to 128), with softcap and a gradient through lse.
    cases += [("d64-bf16-row-intervals-gluon", 64, 64, torch.bfloat16, 0.0, False, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 128, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             row_intervals=True)),
              ("d128-bf16-softcap-dlse-row-intervals-gluon", 128, 128, torch.bfloat16, 30.0, True, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             dynamic=True, row_intervals=True)),
              ("d96-fp16-row-intervals-gluon", 96, 96, torch.float16, 0.0, False, False,
               bwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                             row_intervals=True))]
    for name, D, Dv, dtype, softcap, with_dlse, int64, *forced in cases:
        # As on a Hopper GPU: the default config takes the Gluon kernels.
        bwd._has_gluon_sm90 = (lambda index=None: True) if name.endswith("-gluon") else (lambda index=None: False)
        bwd._default_config.cache_clear()
        T, Hq = 300, 4
        q, k, v = _qkv(T, Hq, D, Dv, dtype, int64)
        o = torch.empty(T, Hq, Dv, dtype=dtype)
        do = torch.empty(T, Hq, Dv, dtype=dtype)
        lse = torch.empty(T, Hq)
        dlse = torch.empty(T, Hq) if with_dlse else None
        qr, kr, mt = _ranges(_docs(T, 3))
        plan = plan_mask(qr, kr, mt, T, T)
        config = forced[0] if forced else bwd.default_config(D, Dv, dtype, torch.device("cuda"), softcap=softcap != 0)
        assert config.gluon_dkdv == name.endswith("-gluon"), (name, config)
        rec = _Recorder()
        bwd.launch = rec
        bwd_fused.launch = rec
        bwd.range_attention_backward_triton(do, q, k, v, o, lse, qr, kr, mt, D ** -0.5, softcap, dlse,
                                            plan=plan, config=config)
        out.append((f"backward {name}", rec))
    return out


def plan_builds():
    """``(name, recorder)`` of the Triton plan: the one-launch path and the many-slice path."""
    from flashrange.kernels import plan as plan_mod

    out = []
    for name, rows, T in (("one-launch", _docs(1000, 5), 1000), ("many-slices", _docs(40000, 300), 40000)):
        qr, kr, mt = _ranges(rows)
        rec = _Recorder()
        plan_mod.launch = rec
        plan_mod.build_plan_triton(qr, kr, mt, T, T)
        out.append((f"plan {name}", rec))
    return out


def build(kernel, args, num_warps, num_stages, maxnreg):
    """One recorded launch built for sm_90 by Triton's compiler (Gluon or Triton source): the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, consts = _signature(kernel, args)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    return triton.compile(source(fn=kernel, signature=sig, constexprs=consts, attrs=_attrs(kernel, args)),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(cubin, flag):
    """The output of the cuobjdump that Triton ships on a cubin (``flag``: ``-res-usage``, ``-sass``), or None
    where this Triton has none."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _resources(cubin):
    """``", registers N, stack B"`` (the stack holds register spills), or ""."""
    text = _cuobjdump(cubin, "-res-usage") or ""
    fields = dict(x.split(":", 1) for x in text.split() if x.startswith(("REG:", "STACK:")))
    if not fields:
        return ""
    return f", registers {fields.get('REG', '?')}, stack {fields.get('STACK', '?')} B"


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET=0: the interpreter does not build kernels")
        return 2
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401 (what build() needs, imported here to check)
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401

        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - an older or CPU-only Triton: nothing can be built here
        print(f"cannot build for sm_90 with this Triton ({type(e).__name__}: {e})")
        return 3
    failures = 0
    seen = set()
    for name, rec in forward_builds() + backward_builds() + plan_builds():
        for kernel, args, num_warps, num_stages, maxnreg in rec.launches:
            sig, consts = _signature(kernel, args)
            key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in consts.items())),
                   num_warps, num_stages, maxnreg)
            if key in seen:
                continue
            seen.add(key)
            t0 = time.perf_counter()
            try:
                compiled = build(kernel, args, num_warps, num_stages, maxnreg)
                assert compiled.asm.get("cubin"), "no cubin"
                # Triton builds a kernel that needs more shared memory than a block may have; it fails at launch.
                assert compiled.metadata.shared <= SM90_MAX_SHARED, (
                    f"needs {compiled.metadata.shared} B of shared memory, more than sm_90's {SM90_MAX_SHARED} B")
                print(f"ok   {name}: {kernel.__name__} ({time.perf_counter() - t0:.1f} s, "
                      f"shared memory {compiled.metadata.shared} B{_resources(compiled.asm['cubin'])})", flush=True)
            except Exception as e:  # noqa: BLE001 - every build is reported, then the run fails
                failures += 1
                print(f"FAIL {name}: {kernel.__name__}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"{len(seen)} builds, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
