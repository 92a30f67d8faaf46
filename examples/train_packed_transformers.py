"""Train a tiny transformers model on packed variable-length documents with the flashrange backend.

Every step packs a fresh set of random-length documents into one row of
exactly ``--tokens`` tokens with transformers' ``DataCollatorWithFlattening``
(``position_ids`` restarting at 0 for each document, the first label of each
document masked). The flashrange backend turns those positions into
document-causal ranges on the device and plans them once per step for all
layers of a mask type (twice for Gemma-2: full and sliding layers), with a
slot count fixed by the step's shape, so the compiled step sees the same
shapes every time and compiles once, however many documents a step holds.

    python examples/train_packed_transformers.py                  # tiny Mistral (sliding window), CPU or GPU
    python examples/train_packed_transformers.py --model gemma2 --steps 50 --tokens 2048
    python examples/train_packed_transformers.py --no-compile     # eager, for comparison

The documents are counting sequences (``start, start + stride, ...`` modulo
the vocabulary, a random start and stride per document), so the loss falls
as the model learns to read the stride from each document's own prefix,
which it can only do if documents do not see each other.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
)

import flashrange.integrations.transformers  # noqa: E402,F401  (registers attn_implementation="flashrange")


def tiny_config(name: str, vocab: int, width: int, layers: int, window: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        attention_dropout=0.0,
    )
    if name == "llama":
        return LlamaConfig(**common)
    if name == "mistral":
        return MistralConfig(sliding_window=window, **common)
    if name == "gemma2":
        return Gemma2Config(head_dim=width // 4, sliding_window=window, attn_logit_softcapping=50.0, **common)
    raise ValueError(f"unknown model {name!r}; choose llama, mistral or gemma2")


def packed_documents(gen: torch.Generator, tokens: int, vocab: int, min_len: int, max_len: int):
    """Counting-sequence documents of random lengths filling exactly ``tokens`` tokens."""
    features, used = [], 0
    while used < tokens:
        n = min(int(torch.randint(min_len, max_len + 1, (1,), generator=gen)), tokens - used)
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        features.append({"input_ids": [(start + stride * i) % vocab for i in range(n)]})
        used += n
    return features


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mistral", choices=["llama", "mistral", "gemma2"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=192, help="tokens per packed step")
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=32, help="sliding window of mistral / gemma2 layers")
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on GPU, f32 on CPU")
    p.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default: inductor on GPU, aot_eager on CPU, where inductor's C++ build is slow)",
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    cfg = tiny_config(args.model, args.vocab, args.width, args.layers, args.window)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashrange").to(device=device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    collator = DataCollatorWithFlattening(return_tensors="pt")

    def loss_fn(input_ids, position_ids, labels):
        return model(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss

    from torch._dynamo.utils import counters

    counters.clear()
    step_fn = loss_fn if args.no_compile else torch.compile(loss_fn, fullgraph=True, backend=backend)
    mode = "eager" if args.no_compile else f"torch.compile(fullgraph=True, backend={backend!r})"
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model}: {n_params / 1e6:.2f}M params, {args.tokens} tokens/step, {dtype}, {device}, {mode}, "
        f"attn_implementation={model.config._attn_implementation!r}"
    )

    t_first = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        features = packed_documents(gen, args.tokens, args.vocab, args.min_len, args.max_len)
        batch = collator(features)
        ids, pos, labels = (batch[k].to(device) for k in ("input_ids", "position_ids", "labels"))
        loss = step_fn(ids, pos, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            loss_value = loss.item()  # the first step includes compilation: time the rest
            t_first = time.perf_counter()
            print(f"step {step:4d}  loss {loss_value:.4f}  docs {len(features):3d}  (first step: {t_first - t0:.1f}s)")
        elif step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  docs {len(features):3d}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    rate = (args.steps - 1) / (t_end - t_first) if args.steps > 1 else float("nan")
    breaks = sum(counters["graph_break"].values())
    print(
        f"{rate:.2f} steps/s, {rate * args.tokens:.0f} tokens/s after the first step; "
        f"graph breaks: {breaks}; total {t_end - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
