"""Context parallelism: one global range mask, its tokens spread over a process group.

- :class:`ContextParallel`: dispatch tokens by mask area, attention that
  moves only the keys each rank's rows read, undispatch; differentiable and
  ``torch.compile``-friendly (communication inside ``flashrange_cp`` ops).
- :func:`plan_context_parallel`: the same planning on the host without
  processes (balance and traffic figures of a simulated job).
- :func:`merge_partials`: exact merge of partial attention results through lse.

Guide: docs/context_parallel.md. Figures for large document masks:
``python -m flashrange.distributed.report``.
"""

from .context import ContextParallel
from .merge import merge_partials
from .planner import ContextParallelPlan, LocalRanges, default_chunk_size, plan_context_parallel

__all__ = [
    "ContextParallel",
    "ContextParallelPlan",
    "LocalRanges",
    "plan_context_parallel",
    "default_chunk_size",
    "merge_partials",
]
