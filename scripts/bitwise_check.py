"""Run a fixed set of forward+backward cases and save every result, to compare two versions bit by bit.

    PYTHONPATH=<tree A> python scripts/bitwise_check.py --save a.pt
    PYTHONPATH=<tree B> python scripts/bitwise_check.py --save b.pt
    python scripts/bitwise_check.py --compare a.pt b.pt

Used to show that a refactor leaves every kernel output bitwise unchanged on
the GPU. Inputs come from fixed seeds; masks from plain lists, so the script
needs nothing but ``flashrange.range_attention``.
"""

import argparse
import random
import zlib

import torch


def _cases():
    rng = random.Random(0)
    docs = [0]
    while docs[-1] < 4096:
        docs.append(min(4096, docs[-1] + rng.randint(17, 700)))
    rand = []
    for _ in range(37):
        qs = rng.randrange(0, 1500); qe = rng.randint(qs, 1531)
        ks = rng.randrange(0, 1700); ke = rng.randint(ks, 1733)
        rand.append(((qs, qe), (ks, ke), rng.randrange(4)))
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for D in (64, 128):
            out.append((f"full-2k-D{D}-{dtype}", 2048, 2048, 8, 8, D, D, [((0, 2048), (0, 2048), 0)], 0.0, dtype))
            out.append((f"causal-3k-D{D}-{dtype}", 3001, 3001, 8, 2, D, D, [((0, 3001), (0, 3001), 1)], 0.0, dtype))
    out.append(("docs-4k-bf16", 4096, 4096, 4, 4, 128, 128,
                [((a, b), (a, b), 1) for a, b in zip(docs[:-1], docs[1:])], 0.0, torch.bfloat16))
    out.append(("random-bf16-softcap", 1531, 1733, 6, 3, 128, 128, rand, 30.0, torch.bfloat16))
    out.append(("random-fp16-D256", 1531, 1733, 4, 2, 256, 256, rand, 0.0, torch.float16))
    out.append(("random-bf16-D96-Dv64", 1531, 1733, 4, 4, 96, 64, rand, 0.0, torch.bfloat16))
    out.append(("window-4k-bf16", 4096, 4096, 8, 8, 128, 128,
                [((0, 511), (0, 512), 1), ((511, 4096), (0, 4096), 3)], 0.0, torch.bfloat16))
    return out


def run(path):
    import flashrange

    dev = "cuda"
    results = {}
    for name, Tq, Tk, Hq, Hkv, D, Dv, slices, softcap, dtype in _cases():
        g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
        q = torch.randn(Tq, Hq, D, device=dev, dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(Tk, Hkv, D, device=dev, dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(Tk, Hkv, Dv, device=dev, dtype=dtype, generator=g).requires_grad_()
        qr = torch.tensor([s[0] for s in slices], dtype=torch.int32, device=dev)
        kr = torch.tensor([s[1] for s in slices], dtype=torch.int32, device=dev)
        mt = torch.tensor([s[2] for s in slices], dtype=torch.int32, device=dev)
        out, lse = flashrange.range_attention(q, k, v, qr, kr, mt, softcap=softcap)
        dout = torch.randn(out.shape, device=dev, dtype=dtype, generator=g)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        results[name] = [t.detach().cpu() for t in (out, lse, dq, dk, dv)]
        print(name, "done", flush=True)
    torch.save(results, path)


def compare(a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    for name in a:
        same = [torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x.view(torch.int32),
                            y.view(torch.uint8) if y.dtype != torch.float32 else y.view(torch.int32))
                for x, y in zip(a[name], b[name])]
        status = "bitwise equal" if all(same) else "DIFFERENT " + str(same)
        bad += not all(same)
        print(f"{name:32s} out/lse/dq/dk/dv: {status}")
    print(f"{len(a) - bad} of {len(a)} cases bitwise equal")
    return bad


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--save")
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.save:
        run(args.save)
    if args.compare:
        raise SystemExit(1 if compare(*args.compare) else 0)
