"""``KVCache``: the keys and values one attention layer has seen, for incremental decoding.

Notation: ``B`` batch, ``H`` heads, ``L`` cached positions, ``D`` head dim (``Dv`` for values).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys (B, H, L, D) and values (B, H, L, Dv) seen so far, for incremental decoding.

    Pass the same cache to every call of one layer. In self-attention (the module's ``key`` is its ``query``)
    each call appends its keys and values, and the queries of that call sit at positions
    ``L_before .. L_before + N - 1``.

    In cross-attention (the module's ``key`` is another tensor: an encoder's memory) the cache holds the memory's
    keys and values once: the first call projects and stores them, later calls reuse them (and must pass the same
    memory), and the queries of each call continue after those of the calls before (:attr:`position`). Which
    kind a cache is, is set by its first call; handing it the other kind is an error. :meth:`reset` empties it.

    ``KVCache()`` grows by concatenation (each call copies the history) and can carry gradients.
    ``KVCache(max_len=T)`` is static: the first call allocates (B, H, T, D) buffers and every call
    writes its keys and values into them in place, so a step costs no copy of the history; ``k`` and
    ``v`` are views of the filled part. Going past ``T`` positions is an error. A static cache is for
    inference: it refuses keys that require gradients (its in-place writes would invalidate saved
    graphs), so use it under ``torch.no_grad()`` / ``torch.inference_mode()``. (A cross-attention cache holds
    the memory's keys and values as they are, up to ``T`` of them.)
    """

    def __init__(self, max_len: int | None = None) -> None:
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"max_len must be None (growing cache) or a positive int, got {max_len!r}")
        self.max_len = max_len
        self.reset()

    def reset(self) -> None:
        """Forget everything (and the kind of attention): the cache is as new, for the next sequence."""
        self._k: torch.Tensor | None = None  # growing: the keys; static: the (B, H, max_len, D) buffer
        self._v: torch.Tensor | None = None
        self._len = 0
        self.kind: str | None = None  # "self" or "cross", set by the first call
        self._memory: tuple[torch.Tensor, torch.Tensor] | None = None  # cross: the (B, M, E) key, value inputs
        self._queries = 0  # cross: queries seen so far

    @property
    def position(self) -> int:
        """Absolute position of the next call's first query: keys cached (self-attention) or queries seen
        (cross-attention)."""
        return self._queries if self.kind == "cross" else self._len

    def __len__(self) -> int:
        return self._len

    @property
    def k(self) -> torch.Tensor | None:
        """The cached keys (B, H, L, D), or None before the first call."""
        return self._k if self._k is None or self.max_len is None or self.kind == "cross" else \
            self._k.narrow(2, 0, self._len)

    @property
    def v(self) -> torch.Tensor | None:
        """The cached values (B, H, L, Dv), or None before the first call."""
        return self._v if self._v is None or self.max_len is None or self.kind == "cross" else \
            self._v.narrow(2, 0, self._len)

    def _check_like(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, H, L, D) and (B, H, L, Dv); got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if self._k is None:
            return
        if k.shape[:2] != self._k.shape[:2]:
            raise ValueError(f"cache holds (B, H) = {tuple(self._k.shape[:2])}, got keys {tuple(k.shape)}")
        if k.shape[3] != self._k.shape[3] or v.shape[3] != self._v.shape[3]:
            raise ValueError(f"cache holds head dims D={self._k.shape[3]}, Dv={self._v.shape[3]}; got keys "
                             f"{tuple(k.shape)} and values {tuple(v.shape)}")

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, L_new, D) keys and (B, H, L_new, Dv) values; return everything cached (self-attention)."""
        self._check_like(k, v)
        new = k.shape[2]
        if self.max_len is None:
            self.claim("self")
            if self._k is None:
                self._k, self._v = k, v
            else:
                self._k, self._v = torch.cat([self._k, k], 2), torch.cat([self._v, v], 2)
            self._len += new
            return self._k, self._v
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError("KVCache(max_len=...) writes in place and cannot carry gradients; decode under "
                               "torch.no_grad() or use a growing KVCache()")
        if self._len + new > self.max_len:
            raise ValueError(f"KVCache(max_len={self.max_len}) holds {self._len} positions; {new} more would "
                             f"exceed max_len")
        if self._k is not None and (k.dtype != self._k.dtype or k.device != self._k.device):
            raise ValueError(f"cache holds {self._k.dtype} on {self._k.device}; got keys {k.dtype} on {k.device}")
        self.claim("self")  # after every check: a refused call leaves the cache as it was
        if self._k is None:
            b, h, _, d = k.shape
            self._k = k.new_empty(b, h, self.max_len, d)
            self._v = v.new_empty(b, h, self.max_len, v.shape[3])
        self._k.narrow(2, self._len, new).copy_(k)
        self._v.narrow(2, self._len, new).copy_(v)
        self._len += new
        return self._k.narrow(2, 0, self._len), self._v.narrow(2, 0, self._len)

    # ------------------------------------------------------------------------------------------ cross-attention

    def claim(self, kind: str) -> None:
        """Take this cache for ``kind`` ("self" or "cross") attention, or refuse: a cache serves one kind."""
        if self.kind is None:
            self.kind = kind
        elif self.kind != kind:
            if self.kind == "self":
                raise ValueError("kv_cache holds self-attention keys (its first call's key was its query); it "
                                 "cannot take different keys than queries. Use one KVCache per attention layer: "
                                 "a separate one for cross-attention")
            raise ValueError("kv_cache holds a cross-attention memory (its first call's key was not its query); "
                             "self-attention needs a KVCache of its own")

    def holds_memory(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether this cross-attention cache holds the projections of ``key``, ``value`` (B, M, kdim|vdim);
        False when empty, a ValueError when it holds another memory (:meth:`reset` first)."""
        if self._memory is None:
            return False
        for name, new, old in (("key", key, self._memory[0]), ("value", value, self._memory[1])):
            same_view = (new.data_ptr() == old.data_ptr() and new.shape == old.shape and new.stride() == old.stride()
                         and new.dtype == old.dtype and new.device == old.device)
            if not same_view and (new.shape != old.shape or not torch.equal(new, old)):
                raise ValueError(f"kv_cache holds the projections of another cross-attention memory ({name} "
                                 f"{tuple(old.shape)}); got {name} {tuple(new.shape)} with other values. Call "
                                 f"kv_cache.reset() before decoding against a new memory")
        self._memory = (key, value)
        return True

    def set_memory(self, key: torch.Tensor, value: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold the projections ``k`` (B, H, M, D), ``v`` (B, H, M, Dv) of memory ``key``, ``value`` (B, M, ...):
        the cache is then a cross-attention one (checked first: a refused memory leaves the cache as it was)."""
        self._check_like(k, v)
        if self.max_len is not None and k.shape[2] > self.max_len:
            raise ValueError(f"KVCache(max_len={self.max_len}) cannot hold a memory of {k.shape[2]} positions")
        self.claim("cross")
        self._memory, self._k, self._v, self._len = (key, value), k, v, k.shape[2]

    def advance(self, queries: int) -> None:
        """Count ``queries`` more queries seen (cross-attention: they set the next call's :attr:`position`)."""
        self._queries += queries

    # ------------------------------------------------------------------------------------------ beam search

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (for beam search); a static cache keeps its buffers when B is unchanged."""
        if self._k is None:
            return
        if self.kind == "cross":
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
            self._memory = tuple(t.index_select(0, index) for t in self._memory)
            return
        if self.max_len is None:
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
            return
        k = self._k[:, :, :self._len].index_select(0, index)
        v = self._v[:, :, :self._len].index_select(0, index)
        if k.shape[0] != self._k.shape[0]:
            self._k = self._k.new_empty(k.shape[0], *self._k.shape[1:])
            self._v = self._v.new_empty(v.shape[0], *self._v.shape[1:])
        self._k[:, :, :self._len] = k
        self._v[:, :, :self._len] = v


__all__ = ["KVCache"]
