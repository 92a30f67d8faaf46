"""End to end: one training step of a Llama-shaped transformers model, per attention implementation.

A Llama model built from a config (no download), in the benchmark dtype,
eager (no ``torch.compile``), ``use_cache=False``, trained on one packed
row: documents of seeded lengths back to back, ``position_ids`` restarting
at 0 for each document, labels masked at each document's first token.
Every implementation (``attn_implementation`` = ``"flashrange"``,
``"sdpa"``, ``"flex_attention"``) gets its own model loaded with the same
state dict, and one step (forward, loss, backward; no optimizer) is timed
with :func:`flashrange.bench.timing.measure`.

How the peers see the packing is transformers' business: from
``position_ids`` alone (no ``attention_mask``), transformers 5 detects the
packed documents and builds a document-causal mask — a dense boolean
``(1, 1, T, T)`` mask for SDPA, a ``BlockMask`` (built every forward) for
FlexAttention — while flashrange turns them into ranges. The table checks
it rather than trusting it: each loss is compared with flashrange's on the
packed row and on the same tokens read as one document; an implementation
that ignored the packing would land on the second.

Needs ``transformers`` (``pip install 'flashrange[transformers]'``).
"""

from __future__ import annotations

import sys
import time

import torch

from .cases import doc_lengths
from .contenders import short_error
from .timing import measure, synchronize

__all__ = ["E2E_SHAPES", "IMPLEMENTATIONS", "llama_config", "packed_row", "run_e2e"]

# (tokens, documents) of the packed row.
E2E_SHAPES = ((4096, 8), (16384, 32))
_TINY_SHAPES = ((64, 4),)
IMPLEMENTATIONS = ("flashrange", "sdpa", "flex_attention")


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def llama_config(tiny: bool):
    """The benchmark's Llama shape, from a config (no download); toy sizes when ``tiny``."""
    from transformers import LlamaConfig

    if tiny:
        sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    else:
        sizes = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=16384)
    cfg = LlamaConfig(attention_dropout=0.0, tie_word_embeddings=False, **sizes)
    cfg.use_cache = False
    return cfg


def packed_row(T: int, n_docs: int, vocab: int, device, *, seed: int = 0):
    """``(input_ids, position_ids, labels)`` `(1, T)`: ``n_docs`` documents packed in one row."""
    lengths = doc_lengths(T, n_docs, seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (1, T), generator=g)
    pos = torch.cat([torch.arange(L) for L in lengths]).unsqueeze(0)
    labels = ids.clone()
    # A document's first token is not predicted from the previous document.
    labels[pos == 0] = -100
    return ids.to(device), pos.to(device), labels.to(device)


def _model(cfg, impl, state, device, dtype):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    model.to(device=device, dtype=dtype)
    model.load_state_dict(state)
    model.train()
    return model


def _step_fn(model, ids, pos, labels):
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        # Optimizer-free: drop the previous step's gradients instead of accumulating into them.
        for p in params:
            p.grad = None
        loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        loss.backward()
        return loss

    return step


def run_e2e(device, dtype, *, tiny, warmup, reps, budget) -> dict:
    """``{"model", "transformers", "rows", "error"}``; one row per (shape, implementation)."""
    device = torch.device(device)
    try:
        import transformers

        import flashrange.integrations.transformers  # noqa: F401 (registers "flashrange")
    except ImportError as e:
        return {"error": f"{short_error(e)}; the transformers table needs pip install 'flashrange[transformers]'",
                "rows": []}
    cfg = llama_config(tiny)
    torch.manual_seed(0)
    with torch.device(device):
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashrange")
    base.to(device=device, dtype=dtype)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    del base
    result = {
        "transformers": transformers.__version__,
        "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
                  "params": sum(v.numel() for v in state.values())},
        "rows": [], "error": None,
    }
    for T, n_docs in (_TINY_SHAPES if tiny else E2E_SHAPES):
        ids, pos, labels = packed_row(T, n_docs, cfg.vocab_size, device)
        one_doc = torch.arange(T, device=device).unsqueeze(0)
        control = None
        shape_rows = []
        for impl in IMPLEMENTATIONS:
            row = {"tokens": T, "docs": n_docs, "impl": impl, "step": None, "loss": None, "peak_mem_bytes": None,
                   "first_call_s": None, "note": ""}
            shape_rows.append(row)
            if impl == "flex_attention" and device.type != "cuda":
                row["note"] = "GPU only here (transformers compiles flex_attention)"
                continue
            if budget.skips(row):
                continue
            _say(f"e2e: {T} tokens, {n_docs} documents: {impl}")
            model = None
            try:
                model = _model(cfg, impl, state, device, dtype)
                step = _step_fn(model, ids, pos, labels)
                t0 = time.perf_counter()
                row["loss"] = float(step().detach())
                synchronize(device)
                row["first_call_s"] = time.perf_counter() - t0
                if impl == "flashrange":
                    control = float(_step_fn(model, ids, one_doc, labels)().detach())
                row["step"] = measure(step, device=device, warmup=warmup, reps=reps).as_dict()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base_bytes = torch.cuda.memory_allocated(device)
                    step()
                    torch.cuda.synchronize(device)
                    row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device) - base_bytes
            except torch.cuda.OutOfMemoryError as e:
                row["note"] = f"out of memory: {short_error(e)[:80]}"
            except Exception as e:  # noqa: BLE001 (an implementation failing is a result)
                row["note"] = short_error(e)
            finally:
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        packed = next((r["loss"] for r in shape_rows if r["impl"] == "flashrange"), None)
        for r in shape_rows:
            r["loss_flashrange"] = packed
            r["loss_one_document"] = control
            if r["loss"] is not None and packed is not None and control is not None:
                r["sees_documents"] = abs(r["loss"] - packed) < abs(r["loss"] - control)
        result["rows"] += shape_rows
    return result
