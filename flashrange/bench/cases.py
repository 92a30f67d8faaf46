"""The benchmark registry: every named case, its mask, and the same mask in the forms peers take.

A :class:`Case` is a problem definition (sizes and mask parameters, no
tensors). :meth:`Case.build` makes its :class:`flashrange.RangeMask` with the
public builders and derives what each peer needs to express the same mask:
SDPA's ``is_causal``, FlashAttention's ``cu_seqlens`` / ``window_size``,
FlexAttention's ``mask_mod``. :meth:`Case.tiny` shrinks a case to toy sizes
for CPU smoke runs; the tests check every mask against its definition.

Tags select cases: ``table`` (the default benchmark table), ``sweep`` (the
launch-config sweep), ``small``, ``irregular`` and ``long``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import random
from dataclasses import dataclass

import torch

from ..mask import RangeMask

__all__ = ["Case", "CaseMask", "CASES", "KINDS", "doc_lengths", "select", "by_name"]

KINDS = ("full", "causal", "document", "longshort", "window", "shared_question", "block_causal")


def doc_lengths(T: int, n_docs: int, seed: int) -> list[int]:
    """``n_docs`` positive lengths summing to ``T``, drawn from ``seed`` (ratio of extremes at most 3)."""
    if n_docs < 1 or n_docs > T:
        raise ValueError(f"cannot split {T} tokens into {n_docs} non-empty documents")
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(n_docs)]
    total = sum(weights)
    running = 0.0
    cuts = [0]
    for w in weights[:-1]:
        running += w
        cuts.append(round(T * running / total))
    cuts.append(T)
    # Rounding can collapse a document at toy sizes: force strictly increasing cuts.
    for i in range(1, n_docs):
        cuts[i] = min(max(cuts[i], cuts[i - 1] + 1), T - (n_docs - i))
    return [b - a for a, b in zip(cuts, cuts[1:])]


@dataclass
class CaseMask:
    """A case's mask in every form a contender needs.

    ``mask``: the :class:`~flashrange.RangeMask`; ``area``: covered cells;
    ``sdpa_causal``: SDPA's ``is_causal`` (``None`` when SDPA needs a dense
    ``attn_mask``); ``cu_seqlens`` / ``max_seqlen``: documents for
    FlashAttention's varlen API; ``window``: keys per query (own key
    included) for FlashAttention's ``window_size``, 0 when none;
    ``mask_mod``: FlexAttention's predicate (``None`` for full attention).
    """

    mask: RangeMask
    area: int
    description: str
    sdpa_causal: bool | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    window: int = 0
    mask_mod: object = None


@dataclass(frozen=True)
class Case:
    """One benchmark problem: sizes and the parameters of one mask kind (see :data:`KINDS`).

    - ``document``: ``n_docs`` causal documents of seeded lengths;
    - ``longshort``: one causal document of ``long_doc`` tokens at a seeded
      place among ``n_docs - 1`` short ones;
    - ``window``: causal sliding window of ``window`` keys, own key included;
    - ``shared_question``: a causal question of ``question`` tokens, then
      ``n_answers`` answers that each see the question and themselves;
    - ``block_causal``: frames of ``block`` tokens that see themselves and
      every earlier frame (video-style).
    """

    name: str
    kind: str
    T: int
    Hq: int = 16
    Hkv: int = 16
    D: int = 128
    Dv: int = 0  # 0: same as D
    n_docs: int = 0
    long_doc: int = 0
    window: int = 0
    question: int = 0
    n_answers: int = 0
    block: int = 0
    seed: int = 0
    tags: tuple = ("table",)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"case {self.name}: unknown kind {self.kind!r}; expected one of {KINDS}")
        if self.Hq % self.Hkv:
            raise ValueError(f"case {self.name}: Hq={self.Hq} is not a multiple of Hkv={self.Hkv}")

    @property
    def head_dim_v(self) -> int:
        return self.Dv or self.D

    # ------------------------------------------------------------ definition

    def doc_lengths(self) -> list[int]:
        """Document lengths, in token order (``document`` and ``longshort`` kinds)."""
        if self.kind == "document":
            return doc_lengths(self.T, self.n_docs, self.seed)
        if self.kind == "longshort":
            short = doc_lengths(self.T - self.long_doc, self.n_docs - 1, self.seed)
            at = random.Random(self.seed + 1).randrange(len(short) + 1)
            return short[:at] + [self.long_doc] + short[at:]
        raise ValueError(f"case {self.name} ({self.kind}) has no documents")

    def answer_lengths(self) -> list[int]:
        """Answer lengths of a ``shared_question`` case: the tokens after the question, split evenly."""
        base, extra = divmod(self.T - self.question, self.n_answers)
        return [base + (1 if a < extra else 0) for a in range(self.n_answers)]

    def tiny(self) -> "Case":
        """The same kind of mask at toy size (odd lengths, few heads, head dim 16) for CPU smoke runs."""
        T = 7 + self.T // 256
        g = self.Hq // self.Hkv
        Hkv = max(1, self.Hkv // 8)
        changes = dict(T=T, Hkv=Hkv, Hq=Hkv * g, D=16, Dv=16 if self.Dv else 0)
        if self.n_docs:
            changes["n_docs"] = min(self.n_docs, max(2, T // 8))
        if self.long_doc:
            changes["long_doc"] = T // 2
        if self.window:
            changes["window"] = max(2, self.window // 256)
        if self.question:
            changes["question"] = max(1, self.question // 256)
            changes["n_answers"] = min(self.n_answers, 3)
        if self.block:
            changes["block"] = max(2, self.block // 256)
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- masks

    def build(self, device) -> CaseMask:
        """This case's mask on ``device``, from the public :class:`~flashrange.RangeMask` builders."""
        T = self.T
        if self.kind == "full":
            m = RangeMask.full(T, device=device)
            return CaseMask(m, m.area(), "full", sdpa_causal=False)
        if self.kind == "causal":
            m = RangeMask.causal(T, device=device)
            return CaseMask(m, m.area(), "causal", sdpa_causal=True, mask_mod=_causal_mod)
        if self.kind in ("document", "longshort"):
            lengths = self.doc_lengths()
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            m = RangeMask.varlen(bounds, causal=True, device=device)
            doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
            if self.kind == "document":
                desc = f"{len(lengths)} causal documents, lengths {min(lengths)}..{max(lengths)}"
            else:
                desc = (f"one causal document of {self.long_doc} among {len(lengths) - 1} short ones "
                        f"({min(lengths)}..{sorted(lengths)[-2] if len(lengths) > 1 else 0})")
            return CaseMask(
                m, m.area(), desc,
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device), max_seqlen=max(lengths),
                mask_mod=_same_part_causal_mod(doc.to(device)),
            )
        if self.kind == "window":
            W = self.window
            m = RangeMask.sliding_window(T, W, causal=True, device=device)
            return CaseMask(m, m.area(), f"causal sliding window of {W} keys (own key included)", window=W,
                            mask_mod=_window_mod(W))
        if self.kind == "shared_question":
            Q, answers = self.question, self.answer_lengths()
            if not (0 < Q < T and 0 < self.n_answers <= T - Q):
                raise ValueError(f"case {self.name}: a question of {Q} and {self.n_answers} answers do not fit in {T}")
            m = RangeMask.shared_question(Q, answers, causal=True, device=device)
            part = torch.repeat_interleave(
                torch.arange(len(answers) + 1, dtype=torch.int32), torch.tensor([Q] + answers)
            )
            desc = (f"causal question of {Q} + {len(answers)} answers of ~{answers[0]}, "
                    "each seeing the question and itself")
            return CaseMask(m, m.area(), desc, mask_mod=_shared_question_mod(part.to(device)))
        if self.kind == "block_causal":
            B = self.block
            m = RangeMask.block_causal(T, B, device=device)
            frames = -(-T // B)
            desc = f"video-style block-causal: {frames} frames of {B} tokens, each sees itself and earlier frames"
            return CaseMask(m, m.area(), desc, mask_mod=_block_causal_mod(B))
        raise AssertionError(self.kind)


# FlexAttention predicates. Module-level factories (not lambdas in build) so
# that each is a small named function in Dynamo's logs.


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _same_part_causal_mod(doc):
    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def _window_mod(W):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < W)

    return sliding_window


def _shared_question_mod(part):
    def shared_question(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((part[kv_idx] == 0) | (part[kv_idx] == part[q_idx]))

    return shared_question


def _block_causal_mod(B):
    def block_causal(b, h, q_idx, kv_idx):
        return kv_idx // B <= q_idx // B

    return block_causal


# ---------------------------------------------------------------------------
# The registry, in priority order: under a time budget the last ones are
# dropped first.

_T = ("table",)
_TS = ("table", "sweep")

CASES: tuple[Case, ...] = (
    Case("full-8k", "full", 8192, tags=_TS),
    Case("causal-8k", "causal", 8192, tags=_T),
    Case("doc16-32k", "document", 32768, n_docs=16, seed=16, tags=_TS),
    Case("doc128-32k", "document", 32768, n_docs=128, seed=128, tags=_TS),
    Case("swa2048-32k", "window", 32768, window=2048, tags=_TS),
    Case("sharedq-32k", "shared_question", 32768, question=4096, n_answers=8, tags=_T),
    Case("full-16k-gqa32:8", "full", 16384, Hq=32, Hkv=8, tags=_T),
    Case("causal-32k", "causal", 32768, tags=_TS),
    Case("full-32k", "full", 32768, tags=_T),
    Case("causal-8k-d64", "causal", 8192, D=64, tags=_TS),
    Case("full-8k-d64", "full", 8192, D=64, tags=_TS),
    Case("causal-1k", "causal", 1024, tags=("table", "small")),
    Case("causal-2k", "causal", 2048, tags=("table", "small")),
    Case("causal-4k", "causal", 4096, tags=("table", "small")),
    Case("doc1024-32k", "document", 32768, n_docs=1024, seed=1024, tags=("table", "irregular")),
    Case("doc4096-32k", "document", 32768, n_docs=4096, seed=4096, tags=("table", "irregular")),
    Case("longshort-32k", "longshort", 32768, n_docs=256, long_doc=16384, seed=7, tags=("table", "irregular")),
    Case("blockcausal-32k", "block_causal", 32768, block=2048, tags=_T),
    Case("doc16-128k", "document", 131072, Hq=8, Hkv=8, n_docs=16, seed=16, tags=("table", "long")),
    Case("doc128-128k", "document", 131072, Hq=8, Hkv=8, n_docs=128, seed=128, tags=("table", "long")),
    Case("doc1024-128k", "document", 131072, Hq=8, Hkv=8, n_docs=1024, seed=1024, tags=("table", "long")),
    Case("doc4096-128k", "document", 131072, Hq=8, Hkv=8, n_docs=4096, seed=4096, tags=("table", "long")),
    Case("causal-128k", "causal", 131072, tags=("table", "long")),
    Case("full-4k-d256", "full", 4096, D=256, tags=("sweep",)),
    # Head dims the Hopper backward pads to 128 (A/Bs of its tile shapes; not in the table).
    Case("full-8k-d96", "full", 8192, D=96, tags=("dims",)),
    Case("causal-8k-d96", "causal", 8192, D=96, tags=("dims",)),
    Case("full-8k-d64v128", "full", 8192, D=64, Dv=128, tags=("dims",)),
    Case("full-8k-d128v64", "full", 8192, D=128, Dv=64, tags=("dims",)),
    # Head dim 64 on short and banded slices (A/Bs of the head-dim-64 schedules; not in the table).
    Case("doc16-32k-d64", "document", 32768, D=64, n_docs=16, seed=16, tags=("dims",)),
    Case("doc128-32k-d64", "document", 32768, D=64, n_docs=128, seed=128, tags=("dims",)),
    Case("swa2048-32k-d64", "window", 32768, D=64, window=2048, tags=("dims",)),
    # One KV head for 16 query heads: few dK/dV work items at short T (A/Bs of BwdConfig.kv_head_chunks).
    Case("causal-8k-mqa", "causal", 8192, Hq=16, Hkv=1, tags=("heads",)),
    Case("full-4k-gqa16:2", "full", 4096, Hq=16, Hkv=2, tags=("heads",)),
)


def by_name(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no benchmark case named {name!r}; cases: {', '.join(c.name for c in CASES)}")


def select(spec: str | None, default_tag: str = "table") -> list[Case]:
    """Cases matching ``spec``: comma-separated names, globs or ``@tag``; every ``default_tag`` case when empty."""
    if not spec:
        return [c for c in CASES if default_tag in c.tags]
    chosen: list[Case] = []
    for pat in (s.strip() for s in spec.split(",")):
        if not pat:
            continue
        if pat.startswith("@"):
            hits = [c for c in CASES if pat[1:] in c.tags]
        else:
            hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pat)]
        if not hits:
            tags = sorted({t for c in CASES for t in c.tags})
            raise ValueError(
                f"no case matches {pat!r}; cases: {', '.join(c.name for c in CASES)}; tags: "
                + ", ".join("@" + t for t in tags)
            )
        chosen += [c for c in hits if c not in chosen]
    return chosen
