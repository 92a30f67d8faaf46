"""Build the backward's kernels for sm_90 without a GPU, for any ``BwdConfig``: registers and stack per kernel.

    TRITON_INTERPRET=0 python scripts/build_bwd_sm90.py D DV "kv_m,kv_n,kv_w,kv_s,q_m,q_n,q_w,q_s[,flags]" ...

``flags``: any of ``dkdv``, ``dq``, ``persistent`` (the Gluon kernels) and ``fused`` (dQ in the key-major
kernel), joined by ``+``. Reuses the recorder and the resource report of ``tests/sm90_builds.py``. With
``DUMP_DIR`` set, each build's cubin and PTX go there (``cuobjdump -sass`` of the cubin shows spills as
``STL`` / ``LDL``); ``SOFTCAP`` (a float) builds the softcap variants.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import sm90_builds as sb  # noqa: E402


def main(argv):
    from ab import backward_config

    from flashrange import plan_mask
    from flashrange.kernels import backward as bwd
    from flashrange.kernels import backward_fused as bwd_fused

    D, Dv = int(argv[0]), int(argv[1])
    softcap = float(os.environ.get("SOFTCAP", "0"))
    for spec in argv[2:]:
        config = backward_config(spec, bwd.BwdConfig)
        T, Hq, dtype = 300, 4, torch.bfloat16
        q, k, v = sb._qkv(T, Hq, D, Dv, dtype, False)
        o = torch.empty(T, Hq, Dv, dtype=dtype)
        qr, kr, mt = sb._ranges(sb._docs(T, 3))
        plan = plan_mask(qr, kr, mt, T, T)
        bwd._has_gluon_sm90 = lambda index=None: True
        rec = sb._Recorder()
        bwd.launch = rec
        bwd_fused.launch = rec
        bwd.range_attention_backward_triton(o, q, k, v, o, torch.empty(T, Hq), qr, kr, mt, D ** -0.5, softcap, None,
                                            plan=plan, config=config)
        for kernel, args, num_warps, num_stages, maxnreg in rec.launches:
            t0 = time.perf_counter()
            try:
                compiled = sb.build(kernel, args, num_warps, num_stages, maxnreg)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"FAIL {spec}: {kernel.__name__}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
                continue
            print(f"ok   {spec}: {kernel.__name__} ({time.perf_counter() - t0:.1f} s, shared memory "
                  f"{compiled.metadata.shared} B{sb._resources(compiled.asm['cubin'])})", flush=True)
            dump = os.environ.get("DUMP_DIR")
            if dump:
                os.makedirs(dump, exist_ok=True)
                stem = os.path.join(dump, f"{kernel.__name__}_d{D}_dv{Dv}_{spec.replace(',', '_').replace('+', '_')}")
                with open(stem + ".cubin", "wb") as f:
                    f.write(compiled.asm["cubin"])
                with open(stem + ".ptx", "w") as f:
                    f.write(compiled.asm["ptx"])


if __name__ == "__main__":
    main(sys.argv[1:])
