"""The transformers backend ``attn_implementation="flashrange"`` against transformers' own attention.

Tiny randomly initialised models built from configs (no download). Every
comparison follows the three-way rule: the golden result is each document
run **alone** in float64 with transformers' ``sdpa`` (``eager`` for Gemma-2,
whose softcap ``sdpa`` ignores), so no padding or packing mask is involved
in it; the reference is ``sdpa``/``eager`` in float32 on the padded or packed
batch; flashrange in float32 on the same batch must be within twice the
reference's error (max norm for logits, L2 norm per gradient tensor), plus
one float32 ulp of the tensor's scale. That covers logits and the gradient
of every parameter, and it is also the check that a
packed batch gives each document the logits it gets alone.

The ranges themselves are checked cell by cell against transformers' mask
functions (``causal_mask_function``, ``sliding_window_overlay``,
``padding_mask_function``, ``packed_sequence_mask_function``).

GPU: ``pytest -m gpu tests/test_transformers.py`` runs the same comparisons
on CUDA (float32 and bfloat16) and the compiled step with inductor.
"""

from __future__ import annotations

import collections
import copy
import inspect
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers import masking_utils as hf_masks  # noqa: E402

import flashrange.integrations.transformers as frt  # noqa: E402
import flashrange.ops as fr_ops  # noqa: E402
from golden import dense_counts  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
HF5 = int(transformers.__version__.split(".")[0]) >= 5
VOCAB = 61

CPU = pytest.param("cpu", torch.float32, id="cpu-f32")
GPU_PARAMS = [
    pytest.param("cuda", torch.float32, id="cuda-f32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
]
DEVICE_DTYPES = [CPU, *GPU_PARAMS]


# --------------------------------------------------------------------------- models


def _config(kind, layers=2):
    """Tiny config and the attention implementation that is the reference for it."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if kind == "llama":  # GQA 4:2
        return LlamaConfig(num_key_value_heads=2, attention_dropout=0.0, **common), "sdpa"
    if kind == "mistral":  # MQA 4:1, every layer a sliding window of 5
        return MistralConfig(num_key_value_heads=1, sliding_window=5, attention_dropout=0.0, **common), "sdpa"
    if kind == "qwen2":  # qkv bias; layer 0 global, layer 1 a sliding window of 4
        cfg = Qwen2Config(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            attention_dropout=0.0,
            **common,
        )
        return cfg, "sdpa"
    if kind == "gemma2":  # softcap, scaling != 1/sqrt(head_dim), sliding/global layers alternate
        cfg = Gemma2Config(
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=5,
            attn_logit_softcapping=1.5,
            query_pre_attn_scalar=12,
            attention_dropout=0.0,
            **common,
        )
        return cfg, "eager"
    if kind == "bert":  # bidirectional encoder
        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=64,
            type_vocab_size=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return cfg, "sdpa"
    raise AssertionError(kind)


def _model(kind, seed=0, layers=2):
    """Float64 model with sharpened attention (scores of order 1, so softcap and scaling matter)."""
    cfg, ref = _config(kind, layers)
    torch.manual_seed(seed)
    if kind == "bert":
        model = BertForMaskedLM._from_config(cfg, attn_implementation=ref)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ref)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                p.mul_(6.0)
    return model, ref


# --------------------------------------------------------------------------- batches


def _docs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    targets = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    return docs, targets


def _padded(docs, sides):
    """Rows padded on the given side; HF's default positions (``arange(S)``) stay in place."""
    S = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), S, dtype=torch.long)
    mask = torch.zeros(len(docs), S, dtype=torch.long)
    spans, positions = [], []
    for b, (d, side) in enumerate(zip(docs, sides)):
        start = 0 if side == "right" else S - len(d)
        ids[b, start : start + len(d)] = d
        mask[b, start : start + len(d)] = 1
        spans.append((b, start, len(d)))
        positions.append(torch.arange(start, start + len(d)))
    return {"input_ids": ids, "attention_mask": mask}, spans, positions


def _packed(docs, how):
    """One row of packed documents; ``how``: ``position_ids`` (restarting) or ``cu_seq_lens``."""
    lens = [len(d) for d in docs]
    ids = torch.cat(docs).unsqueeze(0)
    offsets = torch.tensor([0] + lens).cumsum(0)
    spans = [(0, int(offsets[i]), n) for i, n in enumerate(lens)]
    if how == "position_ids":
        positions = [torch.arange(n) for n in lens]
        batch = {"input_ids": ids, "position_ids": torch.cat(positions).unsqueeze(0)}
    else:
        # Positions run on through the stream, so only cu_seq_lens can split the
        # documents; rotary embeddings are relative, so the golden run alone at the
        # same positions is the same function.
        positions = [torch.arange(int(offsets[i]), int(offsets[i]) + n) for i, n in enumerate(lens)]
        cu = offsets.to(torch.int32)
        batch = {
            "input_ids": ids,
            "position_ids": torch.arange(ids.shape[1]).unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(lens),
            "max_length_k": max(lens),
        }
    return batch, spans, positions


def _reference_batch(docs, layout):
    """What the reference implementation runs: sdpa/eager cannot read cu_seq_lens, so it packs by position_ids."""
    if layout == "cu_seq_lens":
        return _packed(docs, "position_ids")
    return _make_batch(docs, layout)


def _make_batch(docs, layout):
    if layout == "padded":
        return _padded(docs, ["right", "left", "right", "left"][: len(docs)])
    return _packed(docs, layout)


LAYOUT_DOCS = {"padded": [13, 6, 10], "position_ids": [7, 1, 12, 5], "cu_seq_lens": [4, 9, 1, 8]}


# --------------------------------------------------------------------------- runs


def _to(batch, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _loss(per_doc, targets):
    total = sum(len(t) for t in targets)
    ce = torch.nn.functional.cross_entropy
    return sum(ce(lg.float(), t.to(lg.device), reduction="sum") for lg, t in zip(per_doc, targets)) / total


def _run_batch(model, impl, device, dtype, batch, spans, targets, causal_lm=True):
    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    m.set_attn_implementation(impl)
    m.train()
    extra = {"use_cache": False} if causal_lm else {}
    logits = m(**_to(batch, device), **extra).logits
    per_doc = [logits[b, s : s + n] for b, s, n in spans]
    _loss(per_doc, targets).backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in m.named_parameters() if p.grad is not None}
    return torch.cat([x.detach().double().cpu() for x in per_doc]), grads


def _run_golden(model, impl, device, docs, positions, targets, causal_lm=True):
    """Each document alone, float64, no mask: the definition of the right answer."""
    m = copy.deepcopy(model).to(device=device, dtype=torch.float64)
    m.set_attn_implementation(impl)
    m.train()
    extra = {"use_cache": False} if causal_lm else {}
    per_doc = [
        m(input_ids=d.unsqueeze(0).to(device), position_ids=p.unsqueeze(0).to(device), **extra).logits[0]
        for d, p in zip(docs, positions)
    ]
    _loss(per_doc, targets).backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in m.named_parameters() if p.grad is not None}
    return torch.cat([x.detach().double().cpu() for x in per_doc]), grads


def _norm(x, kind):
    return x.abs().max().item() if kind == "max" else x.norm().item()


def _three_way(test, ref, gold, what, floor_scale=0.0, norm="max"):
    """``|test - gold| <= 2 |ref - gold| + floor``; returns the error and the bound.

    ``norm``: ``"max"`` (logits: one wrong position is caught as such) or
    ``"l2"`` (gradients: the max of a few dozen rounding errors, e.g. of a
    norm weight, is too noisy a sample to compare two float32 runs by).
    The floor is one float32 ulp of the tensor's scale, or of ``floor_scale``
    when larger: gradients that are exactly zero in exact arithmetic (a key
    bias, which softmax ignores) are pure rounding noise of their terms.
    """
    err_test = _norm(test - gold, norm)
    err_ref = _norm(ref - gold, norm)
    bound = 2.0 * err_ref + EPS32 * max(_norm(gold, norm), floor_scale)
    assert err_test <= bound, f"{what}: flashrange error {err_test:.3e} > 2 x reference error {err_ref:.3e} + floor"
    return err_test, bound


def _check_against_golden(test, ref, gold):
    (t_logits, t_grads), (r_logits, r_grads), (g_logits, g_grads) = test, ref, gold
    _three_way(t_logits, r_logits, g_logits, "logits")
    assert set(t_grads) == set(g_grads) == set(r_grads)
    floor_scale = 1e-3 * max(g.norm().item() for g in g_grads.values())
    for name in g_grads:
        _three_way(t_grads[name], r_grads[name], g_grads[name], f"grad of {name}", floor_scale, norm="l2")


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("layout", ["padded", "position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2"])
def test_matches_reference(kind, layout, device, dtype):
    """Logits and every parameter's gradient, padded or packed, within 2x the reference's error."""
    model, ref_impl = _model(kind)
    docs, targets = _docs(LAYOUT_DOCS[layout], seed=len(kind) + len(layout))
    batch, spans, positions = _make_batch(docs, layout)
    ref_batch, ref_spans, _ = _reference_batch(docs, layout)
    gold = _run_golden(model, ref_impl, device, docs, positions, targets)
    ref = _run_batch(model, ref_impl, device, dtype, ref_batch, ref_spans, targets)
    test = _run_batch(model, "flashrange", device, dtype, batch, spans, targets)
    _check_against_golden(test, ref, gold)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_bidirectional_encoder_matches_reference(device, dtype):
    """BERT (is_causal=False) with left and right padding: FULL slices over each row's tokens."""
    model, ref_impl = _model("bert")
    docs, targets = _docs([11, 5, 8], seed=3)
    batch, spans, positions = _make_batch(docs, "padded")
    gold = _run_golden(model, ref_impl, device, docs, positions, targets, causal_lm=False)
    ref = _run_batch(model, ref_impl, device, dtype, batch, spans, targets, causal_lm=False)
    test = _run_batch(model, "flashrange", device, dtype, batch, spans, targets, causal_lm=False)
    _check_against_golden(test, ref, gold)


def _disable_softcap(m):
    for mod in m.modules():
        if hasattr(mod, "attn_logit_softcapping"):
            mod.attn_logit_softcapping = None


def _change_scaling(m):
    for mod in m.modules():
        if hasattr(mod, "scaling") and hasattr(mod, "head_dim"):
            mod.scaling = mod.head_dim**-0.5


def _drop_window(m):
    m.config.sliding_window = None
    for mod in m.modules():
        if hasattr(mod, "sliding_window"):
            mod.sliding_window = None


@pytest.mark.parametrize(
    "kind,tamper",
    [
        pytest.param("gemma2", _disable_softcap, id="gemma2-softcap"),
        pytest.param("gemma2", _change_scaling, id="gemma2-scaling"),
        pytest.param("mistral", _drop_window, id="mistral-window"),
    ],
)
def test_comparison_has_teeth(kind, tamper):
    """Forgetting softcap, the model's scaling or its window misses the golden logits by far more than the bound."""
    model, ref_impl = _model(kind)
    docs, targets = _docs(LAYOUT_DOCS["position_ids"], seed=5)
    batch, spans, positions = _make_batch(docs, "position_ids")
    g_logits, _ = _run_golden(model, ref_impl, "cpu", docs, positions, targets)
    r_logits, _ = _run_batch(model, ref_impl, "cpu", torch.float32, batch, spans, targets)
    _, bound = _three_way(r_logits, r_logits, g_logits, "reference")
    tampered = copy.deepcopy(model)
    tamper(tampered)
    t_logits, _ = _run_batch(tampered, "flashrange", "cpu", torch.float32, batch, spans, targets)
    assert (t_logits - g_logits).abs().max().item() > 1000 * bound


# --------------------------------------------------------------------------- compile


def _compile_batches(layout):
    """Batches of one shape whose documents differ: ``(docs, positions, input_ids, aux, labels)``.

    ``aux`` is ``position_ids`` (packed) or ``attention_mask`` (padded).
    Labels never ask a token to predict the first token of a document (as
    DataCollatorWithFlattening does), so every loss term is within a document.
    """
    if layout == "position_ids":
        for i, lengths in enumerate([[7, 1, 12, 5], [3, 9, 4, 6, 3], [25]]):
            docs, _ = _docs(lengths, seed=10 + i)
            batch, spans, positions = _packed(docs, "position_ids")
            yield docs, positions, batch["input_ids"], batch["position_ids"], spans
    else:
        for i, (lengths, sides) in enumerate([([13, 6, 10], ["right", "left", "right"]), ([4, 13, 9], ["left"] * 3)]):
            docs, _ = _docs(lengths, seed=20 + i)
            batch, spans, positions = _padded(docs, sides)
            yield docs, positions, batch["input_ids"], batch["attention_mask"], spans


@pytest.mark.parametrize("device,dtype", [CPU, GPU_PARAMS[0]])
@pytest.mark.parametrize(
    "kind,layout",
    [
        pytest.param("mistral", "position_ids", id="mistral-packed"),
        pytest.param("gemma2", "position_ids", id="gemma2-packed"),
        pytest.param("gemma2", "padded", id="gemma2-padded"),
    ],
)
def test_compiled_training_step_has_no_graph_break(kind, layout, device, dtype):
    """torch.compile(fullgraph=True) of forward + loss; backward; 0 graph breaks; new masks never recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    model, ref_impl = _model(kind)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    m.set_attn_implementation("flashrange")
    m.train()
    aux_name = layout if layout == "position_ids" else "attention_mask"

    def step(input_ids, aux, labels):
        return m(input_ids=input_ids, labels=labels, use_cache=False, **{aux_name: aux}).loss

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    n_batches = 0
    for docs, positions, input_ids, aux, spans in _compile_batches(layout):
        n_batches += 1
        labels = torch.full_like(input_ids, -100)
        for (b, s, n), d in zip(spans, docs):
            labels[b, s + 1 : s + n] = d[1:]
        args = (input_ids.to(device), aux.to(device), labels.to(device))
        m.zero_grad()
        loss = compiled(*args)
        loss.backward()
        t_grads = {n: p.grad.detach().double().cpu() for n, p in m.named_parameters() if p.grad is not None}

        gold_m = copy.deepcopy(model).to(device)
        gold_m.set_attn_implementation(ref_impl)
        gold_m.train()
        gold_loss = sum(
            gold_m(
                input_ids=d.unsqueeze(0).to(device),
                position_ids=p.unsqueeze(0).to(device),
                labels=d.unsqueeze(0).to(device),
                use_cache=False,
            ).loss
            * (len(d) - 1)
            for d, p in zip(docs, positions)
            if len(d) > 1  # a one-token document predicts nothing
        ) / sum(len(d) - 1 for d in docs)
        gold_loss.backward()
        g_grads = {n: p.grad.detach().double().cpu() for n, p in gold_m.named_parameters() if p.grad is not None}

        ref_m = copy.deepcopy(model).to(device=device, dtype=dtype)
        ref_m.set_attn_implementation(ref_impl)
        ref_m.train()
        ref_loss = ref_m(input_ids=args[0], labels=args[2], use_cache=False, **{aux_name: args[1]}).loss
        ref_loss.backward()
        r_grads = {n: p.grad.detach().double().cpu() for n, p in ref_m.named_parameters() if p.grad is not None}

        gl = gold_loss.detach().double().cpu().reshape(1)
        _three_way(loss.detach().double().cpu().reshape(1), ref_loss.detach().double().cpu().reshape(1), gl, "loss")
        floor_scale = 1e-3 * max(g.norm().item() for g in g_grads.values())
        for name in g_grads:
            _three_way(t_grads[name], r_grads[name], g_grads[name], f"grad of {name}", floor_scale, norm="l2")

    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert backend.frame_count == 1, f"compiled {backend.frame_count} times for {n_batches} batches of one shape"
    # The mask function's plan is in the graph once per mask type, not once per layer.
    plans = sum(str(n.target).startswith("flashrange.plan") for g in backend.graphs for n in g.graph.nodes)
    assert plans == MASK_TYPES[kind], f"{plans} plan ops in the compiled graph, expected {MASK_TYPES[kind]}"


# --------------------------------------------------------------------------- plan once per forward

# Distinct mask types per model (transformers builds one mask per type and forward):
# Mistral's layers all slide, Qwen2 has a global layer and sliding ones, Gemma-2 alternates.
MASK_TYPES = {"llama": 1, "mistral": 1, "qwen2": 2, "gemma2": 2, "bert": 1}


class _OpCounter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher (flashrange's custom ops included) while active.

    Eager planning on CUDA calls ``ops.plan_eager`` instead of the ``flashrange::plan`` op, so plans
    counts both: that function is wrapped while the mode is active.
    """

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self._plan_eager = None

    def __enter__(self):
        self._plan_eager = fr_ops.plan_eager

        def counted(*args):
            self.counts["plan_eager"] += 1
            return self._plan_eager(*args)

        fr_ops.plan_eager = counted
        return super().__enter__()

    def __exit__(self, *exc):
        fr_ops.plan_eager = self._plan_eager
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def plans(self):
        return self.counts["flashrange.plan"] + self.counts["plan_eager"]


def _flashrange_model(kind, layers):
    model, _ = _model(kind, layers=layers)
    model = model.float()
    model.set_attn_implementation("flashrange")
    return model.train()


@pytest.mark.parametrize("layout", ["padded", "position_ids"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2", "bert"])
def test_plans_once_per_mask_type(kind, layout):
    """A forward + backward of a 4-layer model plans each mask type once; the layers and the backward reuse it."""
    if kind == "bert" and layout != "padded":
        pytest.skip("an encoder has no packing")
    if kind == "bert" and not HF5:
        pytest.skip("transformers 4 builds BERT's masks without the mask interface: each layer plans")
    layers = 4
    model = _flashrange_model(kind, layers)
    docs, _ = _docs(LAYOUT_DOCS[layout], seed=2)
    batch, _, _ = _make_batch(docs, layout)
    extra = {} if kind == "bert" else {"use_cache": False}
    with _OpCounter() as counter:
        model(**batch, **extra).logits.sum().backward()
    assert counter.counts["flashrange.fwd"] == layers
    assert counter.counts["flashrange.bwd"] == layers
    assert counter.plans == MASK_TYPES[kind], f"{counter.plans} plans for {MASK_TYPES[kind]} mask types"


@pytest.mark.parametrize("layout", ["padded", "position_ids"])
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_planned_layers_match_per_layer_ranges(kind, layout, monkeypatch):
    """The mask function's ranges and plan give bitwise the logits and gradients of ranges built in each layer."""
    model = _flashrange_model(kind, layers=3)
    docs, targets = _docs(LAYOUT_DOCS[layout], seed=4)
    batch, spans, _ = _make_batch(docs, layout)
    planned = _run_batch(model, "flashrange", "cpu", torch.float32, batch, spans, targets)
    monkeypatch.setattr(frt, "_fits", lambda *args: False)  # every layer takes the per-layer path
    with _OpCounter() as counter:
        per_layer = _run_batch(model, "flashrange", "cpu", torch.float32, batch, spans, targets)
    assert counter.plans == MASK_TYPES[kind] + 3, "the per-layer path did not run"
    assert torch.equal(planned[0], per_layer[0])
    for name, grad in planned[1].items():
        assert torch.equal(grad, per_layer[1][name]), name


def test_cu_seq_lens_plan_in_each_layer():
    """cu_seq_lens reach only the attention call, so each layer builds and plans its own ranges.

    (The mask function, which cannot see them, has planned the unpacked rows once by then.)
    """
    layers = 3
    model = _flashrange_model("llama", layers)
    docs, _ = _docs(LAYOUT_DOCS["cu_seq_lens"], seed=6)
    batch, _, _ = _make_batch(docs, "cu_seq_lens")
    with _OpCounter() as counter:
        model(**batch, use_cache=False)
    assert counter.plans == 1 + layers


def _mask_kwargs(cfg, embeds, attention_mask, position_ids):
    """Arguments of transformers' ``create_*_mask`` without a cache, in the spelling of the installed version."""
    params = inspect.signature(hf_masks.create_causal_mask).parameters
    kw = {"config": cfg, "attention_mask": attention_mask, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    kw["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:  # transformers 4 passes it to the mask function instead of q_length / q_offset
        kw["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return kw


def _planned_mask(kind, batch):
    """What transformers hands the layers of the model's one mask type for ``batch`` (through our mask function)."""
    cfg, _ = _config(kind)
    cfg._attn_implementation = "flashrange"
    ids = batch["input_ids"]
    kw = _mask_kwargs(cfg, torch.zeros(*ids.shape, 8), batch.get("attention_mask"), batch.get("position_ids"))
    if kind == "llama":
        return hf_masks.create_causal_mask(**kw), None
    return hf_masks.create_sliding_window_causal_mask(**kw), cfg.sliding_window


def _dense(planned):
    B, S = planned.batch_size, planned.q_length
    cov = dense_counts(planned.q_ranges, planned.k_ranges, planned.mask_types, B * S, B * planned.kv_length)
    assert int(cov.max()) <= 1, "slices overlap"
    return torch.stack([cov.view(B, S, B, -1)[b, :, b] for b in range(B)]).bool()


def _assert_compacted(q_ranges, k_ranges, mask_types):
    live = (q_ranges[:, 1] > q_ranges[:, 0]) & (k_ranges[:, 1] > k_ranges[:, 0])
    n = int(live.sum())
    assert bool(live[:n].all()), "an empty slice sits between documents"
    assert not q_ranges[n:].any() and not k_ranges[n:].any() and not mask_types[n:].any(), "padding is not [0, 0) FULL"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("packed", [True, False], ids=["restarting", "one-document"])
def test_mask_function_ranges(kind, packed):
    """The mask function's slices match transformers' masks; packed rows get B*S slots, the rest one per row.

    transformers finds the packing (transformers 5 in eager mode: only in
    positions that restart; 4: in any position_ids); our mask function reads
    it off the mask function it is given.
    """
    B, S = 2, 17
    if packed:
        pos = torch.cat([torch.arange(5), torch.arange(1), torch.arange(7), torch.arange(4)]).expand(B, S)
    else:
        pos = torch.arange(S).expand(B, S)
    planned, window = _planned_mask(kind, {"input_ids": torch.zeros(B, S, dtype=torch.long), "position_ids": pos})
    assert isinstance(planned, frt.PlannedMask)
    assert planned.padding is None and planned.causal and planned.sliding_window == window
    assert torch.equal(_dense(planned), _hf_oracle(B, S, S, True, window, position_ids=pos))
    per_doc = 1 if window is None else 3
    assert planned.mask_types.shape[0] == (B * S if packed or not HF5 else per_doc * B)
    _assert_compacted(planned.q_ranges, planned.k_ranges, planned.mask_types)


@pytest.mark.parametrize("window", [None, 3], ids=lambda w: f"window{w}")
def test_mask_function_ranges_under_compile(window):
    """Traced, transformers always hands over its packed-sequence function; the slices and capacity follow it."""
    B, S = 2, 13
    cfg, _ = _config("mistral" if window else "llama")
    if window:
        cfg.sliding_window = window
    cfg._attn_implementation = "flashrange"
    create = hf_masks.create_sliding_window_causal_mask if window else hf_masks.create_causal_mask

    def ranges(embeds, pos):
        planned = create(**_mask_kwargs(cfg, embeds, None, pos))
        return planned.q_ranges, planned.k_ranges, planned.mask_types

    compiled = torch.compile(ranges, fullgraph=True, backend="eager")
    for pos in (
        torch.stack([torch.cat([torch.arange(6), torch.arange(7)]), torch.arange(S)]),
        torch.arange(S).expand(B, S),
    ):
        qr, kr, mt = compiled(torch.zeros(B, S, 8), pos)
        assert mt.shape[0] == B * S
        _assert_compacted(qr, kr, mt)
        cov = dense_counts(qr, kr, mt, B * S, B * S).view(B, S, B, S)
        ours = torch.stack([cov[b, :, b] for b in range(B)]).bool()
        assert torch.equal(ours, _hf_oracle(B, S, S, True, window, position_ids=pos))


def test_planned_mask_padding_and_bidirectional():
    """Padding masks give one document per row (three slices with a window), compacted; encoders get FULL rows."""
    docs, _ = _docs([13, 6, 10], seed=1)
    batch, _, _ = _padded(docs, ["right", "left", "right"])
    for kind in ("llama", "mistral"):
        planned, window = _planned_mask(kind, batch)
        assert planned.mask_types.shape[0] == 3 * (1 if window is None else 3)
        _assert_compacted(planned.q_ranges, planned.k_ranges, planned.mask_types)
        mask = batch["attention_mask"]
        valid = _valid_queries(mask, mask.shape[1])
        assert torch.equal(_dense(planned)[valid], _hf_oracle(3, 13, 13, True, window, mask=mask)[valid])
    if not HF5:
        return  # transformers 4 builds no bidirectional masks through the mask interface
    cfg, _ = _config("bert")
    cfg._attn_implementation = "flashrange"
    planned = hf_masks.create_bidirectional_mask(
        config=cfg, inputs_embeds=torch.zeros(3, 13, 8), attention_mask=batch["attention_mask"]
    )
    assert not planned.causal
    assert torch.equal(_dense(planned), _hf_oracle(3, 13, 13, False, None, mask=batch["attention_mask"]))


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("device,dtype", [CPU, GPU_PARAMS[0]])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_generate_left_padded_with_sliding_cache(kind, device, dtype):
    """Greedy decoding through a dynamic cache whose sliding layers drop old keys (kv_offset > 0).

    Mistral: every layer slides; Qwen2: a global layer and a sliding one. Each
    step (prefill, then one token at a time) plans each mask type once.
    """
    model, ref_impl = _model(kind, layers=3)
    docs, _ = _docs([9, 6], seed=7)
    batch, _, _ = _padded(docs, ["left", "left"])
    runs = {}
    for name, impl, dt in [("gold", ref_impl, torch.float64), ("ref", ref_impl, dtype), ("test", "flashrange", dtype)]:
        m = copy.deepcopy(model).to(device=device, dtype=dt).eval()
        m.set_attn_implementation(impl)
        steps = []
        m.model.register_forward_pre_hook(lambda *_: steps.append(1))
        with torch.no_grad(), _OpCounter() as counter:
            out = m.generate(
                **_to(batch, device),
                max_new_tokens=7,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        runs[name] = (out.sequences.cpu(), torch.stack(out.logits).double().cpu())
        if impl == "flashrange":
            assert counter.plans == len(steps) * MASK_TYPES[kind], f"{counter.plans} plans in {len(steps)} steps"
    assert torch.equal(runs["test"][0], runs["gold"][0])
    _three_way(runs["test"][1], runs["ref"][1], runs["gold"][1], "generation logits")


# --------------------------------------------------------------------------- ranges, cell by cell


def _hf_oracle(B, Sq, Sk, causal, window, mask=None, position_ids=None):
    """Dense ``(B, Sq, Sk)`` bool from transformers' own mask functions (queries are the last keys)."""
    b = torch.arange(B).view(B, 1, 1)
    q = torch.arange(Sq).view(1, Sq, 1) + (Sk - Sq)
    kv = torch.arange(Sk).view(1, 1, Sk)
    h = torch.zeros((), dtype=torch.long)
    dense = torch.ones(B, Sq, Sk, dtype=torch.bool)
    if causal:
        dense &= hf_masks.causal_mask_function(b, h, q, kv)
    if window is not None:
        dense &= hf_masks.sliding_window_overlay(window)(b, h, q, kv)
    if mask is not None:
        dense &= hf_masks.padding_mask_function(mask.bool())(b, h, q, kv)
    if position_ids is not None:
        packed = hf_masks.find_packed_sequence_indices(position_ids.expand(B, -1))
        if packed is not None:
            dense &= hf_masks.packed_sequence_mask_function(packed)(b, h, q, kv)
    return dense


def _ours(B, Sq, Sk, **kw):
    qr, kr, mt = frt.build_ranges(B, Sq, Sk, device="cpu", **kw)
    assert qr.dtype == kr.dtype == mt.dtype == torch.int32
    _assert_compacted(qr, kr, mt)
    cov = dense_counts(qr, kr, mt, B * Sq, B * Sk)
    assert int(cov.max()) <= 1, "slices overlap"
    blocks = cov.view(B, Sq, B, Sk)
    for b1 in range(B):
        for b2 in range(B):
            if b1 != b2:
                assert int(blocks[b1, :, b2].sum()) == 0, "a row attends another row"
    return torch.stack([blocks[b, :, b] for b in range(B)]).bool(), qr.shape[0]


def _valid_queries(mask, Sq):
    return mask.bool()[:, mask.shape[1] - Sq :]


@pytest.mark.parametrize("window", [None, 1, 4, 100], ids=lambda w: f"window{w}")
@pytest.mark.parametrize(
    "Sq,Sk", [pytest.param(13, 13, id="prefill"), pytest.param(3, 11, id="cache"), pytest.param(1, 7, id="decode")]
)
def test_padding_ranges_match_transformers_masks(Sq, Sk, window):
    mask = torch.ones(4, Sk, dtype=torch.long)
    mask[1, : Sk // 2] = 0  # left padding
    mask[2, Sk - 2 :] = 0  # right padding
    mask[3, :] = 0  # nothing at all
    ours, _ = _ours(4, Sq, Sk, attention_mask=mask.bool(), causal=True, sliding_window=window)
    oracle = _hf_oracle(4, Sq, Sk, True, window, mask=mask)
    valid = _valid_queries(mask, Sq)
    assert torch.equal(ours[valid], oracle[valid])
    assert not ours[~valid].any(), "padded queries attend nothing"


@pytest.mark.parametrize("Sq,Sk", [pytest.param(9, 9, id="self"), pytest.param(5, 12, id="cross")])
def test_bidirectional_ranges_match_transformers_masks(Sq, Sk):
    mask = torch.ones(3, Sk, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, Sk - 4 :] = 0
    ours, _ = _ours(3, Sq, Sk, attention_mask=mask.bool(), causal=False)
    assert torch.equal(ours, _hf_oracle(3, Sq, Sk, False, None, mask=mask))
    ours_nomask, _ = _ours(3, Sq, Sk, causal=False)
    assert ours_nomask.all()


@pytest.mark.parametrize("window", [None, 1, 3, 50], ids=lambda w: f"window{w}")
def test_packed_ranges_match_transformers_masks(window):
    # Row 0: documents 5, 1, 7, 4 (restarting at 0); row 1: one jump of positions; row 2: one document.
    pos = torch.stack(
        [
            torch.cat([torch.arange(5), torch.arange(1), torch.arange(7), torch.arange(4)]),
            torch.cat([torch.arange(10), torch.arange(40, 47)]),
            torch.arange(17),
        ]
    )
    ours, n_slices = _ours(3, 17, 17, position_ids=pos, causal=True, sliding_window=window)
    assert torch.equal(ours, _hf_oracle(3, 17, 17, True, window, position_ids=pos))
    # The slice count is a function of the shape only: one slot per token, windowed or not.
    _, n_other = _ours(3, 17, 17, position_ids=torch.arange(17).expand(3, 17), causal=True, sliding_window=window)
    assert n_slices == n_other == 3 * 17


@pytest.mark.parametrize("window", [None, 2, 6], ids=lambda w: f"window{w}")
def test_cu_seq_lens_ranges(window):
    lens = [5, 1, 7, 4]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    ours, _ = _ours(1, 17, 17, cu_seq_lens_q=cu, cu_seq_lens_k=cu, causal=True, sliding_window=window)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    assert torch.equal(ours, _hf_oracle(1, 17, 17, True, window, position_ids=pos))


# --------------------------------------------------------------------------- registration and errors


def test_import_flashrange_registers_nothing():
    code = (
        "import flashrange, transformers\n"
        "from transformers import AttentionInterface\n"
        "assert 'flashrange' not in AttentionInterface._global_mapping\n"
        "import flashrange.integrations.transformers\n"
        "assert 'flashrange' in AttentionInterface._global_mapping\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_from_config_and_set_attn_implementation_select_it(monkeypatch):
    calls = []
    fwd = frt.attention

    def counting_fwd(*args, **kwargs):
        calls.append(args[0].shape)
        return fwd(*args, **kwargs)

    monkeypatch.setattr(frt, "attention", counting_fwd)
    cfg, _ = _config("llama")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashrange")
    assert model.config._attn_implementation == "flashrange"
    model(input_ids=torch.randint(1, VOCAB, (2, 5)), use_cache=False)
    assert len(calls) == cfg.num_hidden_layers
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("flashrange")
    assert model.config._attn_implementation == "flashrange"
    assert frt.register() == "flashrange"  # idempotent


def _llama(**overrides):
    cfg, _ = _config("llama")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="flashrange")


def test_error_output_attentions():
    with pytest.raises(ValueError, match="output_attentions"):
        _llama()(input_ids=torch.randint(1, VOCAB, (1, 6)), output_attentions=True, use_cache=False)


def test_error_dropout_in_training():
    model = _llama(attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=torch.randint(1, VOCAB, (1, 6)), use_cache=False)
    model.eval()(input_ids=torch.randint(1, VOCAB, (1, 6)), use_cache=False)  # no dropout in eval


def test_error_dense_4d_mask():
    bias = torch.zeros(1, 1, 6, 6)
    with pytest.raises(ValueError, match="4-D mask or additive bias"):
        _llama()(input_ids=torch.randint(1, VOCAB, (1, 6)), attention_mask=bias, use_cache=False)


def test_error_mask_with_holes(monkeypatch):
    """Strict mode (a host read, so never by default) reports a padding mask with holes."""
    monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 3] = 0
    with pytest.raises(ValueError, match="holes"):
        _llama()(input_ids=torch.randint(1, VOCAB, (2, 7)), attention_mask=mask, use_cache=False)


def test_error_unsupported_patterns():
    with pytest.raises(NotImplementedError, match="bidirectional sliding"):
        frt.build_ranges(1, 5, 5, causal=False, sliding_window=3)
    with pytest.raises(ValueError, match="static KV caches"):
        frt.flashrange_mask(batch_size=1, kv_length=8, kv_offset=0, attention_mask=torch.ones(1, 5, dtype=torch.bool))
    overlay = hf_masks.or_masks(hf_masks.causal_mask_function, lambda b, h, q, kv: q >= 0)
    with pytest.raises(NotImplementedError, match="overlays"):
        frt.flashrange_mask(batch_size=1, kv_length=5, mask_function=overlay, attention_mask=None)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("layout", ["position_ids", "cu_seq_lens"])
def test_gradient_checkpointing_matches_plain_training(layout, reentrant):
    """``gradient_checkpointing_enable`` re-runs each layer's attention inside the backward: logits and every
    parameter's gradient equal the plain step's, bit for bit (CPU here; the op-level GPU twin is
    tests/test_gpu_eager.py::test_activation_checkpointing_reruns_the_forward_in_the_backward)."""
    docs, targets = _docs(LAYOUT_DOCS[layout], seed=4)
    batch, spans, _ = _make_batch(docs, layout)

    layers = 2

    def step(checkpointing):
        model = _flashrange_model("llama", layers=layers)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with _OpCounter() as counter:
            logits = model(**batch, use_cache=False).logits
            _loss([logits[b, s : s + n] for b, s, n in spans], targets).backward()
        # Checkpointing really ran: every layer's attention forward ran twice.
        assert counter.counts["flashrange.fwd"] == layers * (2 if checkpointing else 1)
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (plain_logits, plain_grads), (ckpt_logits, ckpt_grads) = step(False), step(True)
    assert torch.equal(plain_logits, ckpt_logits)
    assert plain_grads.keys() == ckpt_grads.keys() and len(plain_grads) > 0
    for name in plain_grads:
        assert torch.equal(plain_grads[name], ckpt_grads[name]), name
