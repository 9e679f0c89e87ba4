"""The transformers engine's KV cache: a ``DynamicCache`` whose layers grow in place and whose rows can be split
off into a cache of their own and merged back.

``DynamicLayer`` appends with ``torch.cat``, copying the whole cache in every layer at every decode step; a
``RoomyLayer`` keeps its keys and values as views into buffers with room to grow, so a step writes one column.
"""

from __future__ import annotations

import copy

import torch

try:  # transformers >= 4.56 keeps a DynamicCache's tensors in per-layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older caches are used as the model returns them
    DynamicLayer = None

#: Columns a layer grows by beyond what is asked for, so that a turn's feed rarely copies the cache again.
SPARE = 64


class RoomyLayer(DynamicLayer or object):  # (``object``: never built then, make_roomy declines)
    """A ``DynamicLayer`` whose keys and values are views into zero-filled buffers with room to grow.

    The room stays zero until written, so columns added for some rows only (:meth:`append_rows`) hold finite
    values where the other rows are masked: a masked column gets weight exactly 0, so what it holds never
    changes a result.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.is_initialized, self.device, self.dtype = True, keys.device, keys.dtype
        self._hold(keys, values, room)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        B, H, n, D = keys.shape
        self._k, self._v = keys.new_empty((B, H, n + room, D)), values.new_empty((B, H, n + room, D))
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self._k[:, :, n:], self._v[:, :, n:] = 0, 0
        self._view(n)

    def _view(self, n: int) -> None:
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]  # (B, H, n, D)

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more columns: one copy now instead of one per step."""
        if self.keys.shape[-2] + extra > self._k.shape[-2]:
            self._hold(self.keys, self.values, extra + SPARE)

    def update(self, key_states, value_states, *args, **kwargs):
        n, s = self.keys.shape[-2], key_states.shape[-2]
        self.reserve(s)
        self._k[:, :, n:n + s], self._v[:, :, n:n + s] = key_states, value_states
        self._view(n + s)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._view(self.keys.shape[-2])

    def drop_leading(self, first: int) -> None:
        n = self.keys.shape[-2]
        self._k, self._v = self._k[:, :, first:], self._v[:, :, first:]
        self._view(n - first)

    def append_rows(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` (len(rows), H, k, D) as ``k`` new columns of ``rows``; the others get zeros."""
        n, k = self.keys.shape[-2], keys.shape[-2]
        self.reserve(k)
        self._k[rows, :, n:n + k], self._v[rows, :, n:n + k] = keys, values
        self._view(n + k)


def make_roomy(cache, room: int) -> bool:
    """Turn the plain ``DynamicLayer``s of ``cache`` into RoomyLayers with ``room`` spare columns; False (and the
    cache left as it is) for any other cache."""
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(la) is not DynamicLayer for la in layers):
        return False
    layers[:] = [RoomyLayer(la.keys, la.values, room) for la in layers]
    return True


def split_rows(cache, rows: torch.Tensor, room: int):
    """A cache of copies of ``rows`` of a roomy ``cache``, with ``room`` spare columns."""
    sub = copy.copy(cache)
    sub.layers = [RoomyLayer(la.keys[rows], la.values[rows], room) for la in cache.layers]
    return sub


def merge_rows(cache, sub, rows: torch.Tensor, start: int) -> None:
    """Append the columns ``sub`` (split from ``rows`` when both held ``start`` columns) added since to ``cache``,
    as columns of zeros for the other rows."""
    for la, s in zip(cache.layers, sub.layers):
        la.append_rows(rows, s.keys[:, :, start:], s.values[:, :, start:])
