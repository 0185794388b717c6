"""Context parallelism: Shaw attention over a sequence split across the ranks of a ``torch.distributed`` group.

Each rank holds ``n`` positions of q, k and v (which ones: the *layout*, :mod:`.layouts`), and
:func:`context_parallel_attention` gives it the output of those positions, exactly what
:func:`relattn.relative_attention` gives on the whole sequence, with the op's whole argument set (a keyword it does
not serve, dropout, is refused). The keys and values travel around a ring (:mod:`.ring`), and each chunk pair is one
call of a backend that declares ``Serves(chunk_pairs=True)`` (``native`` on the CPU, ``triton`` on CUDA,
``blocked`` anywhere; ``"auto"`` takes the device's priority list).

A model runs under context parallelism by passing a :class:`ContextParallel` to its attention modules:
``RelativeMultiheadAttention.forward(x, ..., context_parallel=cp)`` runs the module's own forward (every option:
``rel_q``, grouped heads, LogBuckets, windows) with the ring in place of the op.

Gradients: q, k, v get the gradients of the local positions. A table's gradient on each rank is that rank's
share; their sum over the group is the single-process gradient, as for every parameter under context
parallelism (the projections' gradients are shares too). DistributedDataParallel or FSDP over all ranks
complete them: with each rank's loss the mean over its own positions, their average over the world is the
gradient of the global mean loss.
"""

from .attention import ContextParallel, context_parallel_attention
from .layouts import LAYOUTS, gather, positions, segments, shard
from .ring import record_timeline

__all__ = ["LAYOUTS", "ContextParallel", "context_parallel_attention", "gather", "positions", "record_timeline",
           "segments", "shard"]
