"""The transformers engine's KV cache: a ``DynamicCache`` whose layers grow in place and whose rows can be split
off into a cache of their own and merged back, and attention that reads its grouped key/value heads in place.

``DynamicLayer`` appends with ``torch.cat``, copying the whole cache in every layer at every decode step; a
``RoomyLayer`` keeps its keys and values as views into buffers with room to grow, so a step writes one column.
Rows can also be added to a cache (:func:`add_rows`): episodes that join a running batch.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

try:  # transformers >= 4.56 keeps a DynamicCache's tensors in per-layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older caches are used as the model returns them
    DynamicLayer = None
_PLAIN_LAYER = DynamicLayer  # the plain layer class, for add_rows (whether make_roomy may take it or not)

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

    def add_rows(self, k: int) -> None:
        """Append ``k`` rows holding zeros in every column, room included."""
        n = self.keys.shape[-2]
        self._k = torch.cat([self._k, self._k.new_zeros((k, *self._k.shape[1:]))])
        self._v = torch.cat([self._v, self._v.new_zeros((k, *self._v.shape[1:]))])
        self._view(n)

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


def add_rows(cache, k: int) -> bool:
    """Append ``k`` rows of zeros to every layer of ``cache`` (RoomyLayers or plain ``DynamicLayer``s): rows whose
    attention mask is zero over every column the cache holds so far, so what they hold there is never read. False,
    and the cache left as it is, for any other cache (older transformers' caches, sliding windows, ...)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    if all(type(la) is RoomyLayer for la in layers):
        for la in layers:
            la.add_rows(k)
        return True
    if _PLAIN_LAYER is None or any(type(la) is not _PLAIN_LAYER or getattr(la, "keys", None) is None
                                   for la in layers):
        return False
    for la in layers:
        la.keys = torch.cat([la.keys, la.keys.new_zeros((k, *la.keys.shape[1:]))])
        la.values = torch.cat([la.values, la.values.new_zeros((k, *la.values.shape[1:]))])
    return True


def add_columns(cache, k: int) -> None:
    """Append ``k`` columns of zeros to every row of every layer of a cache :func:`add_rows` takes."""
    for la in cache.layers:
        n = la.keys.shape[-2]
        if type(la) is RoomyLayer:
            la.reserve(k)
            la._k[:, :, n:n + k], la._v[:, :, n:n + k] = 0, 0
            la._view(n + k)
        else:
            la.keys = torch.cat([la.keys, la.keys.new_zeros((*la.keys.shape[:2], k, la.keys.shape[-1]))], dim=-2)
            la.values = torch.cat([la.values, la.values.new_zeros((*la.values.shape[:2], k, la.values.shape[-1]))],
                                  dim=-2)


def write_rows(cache, src, rows: torch.Tensor, start: int) -> bool:
    """Write the keys and values of ``src`` (a cache of ``len(rows)`` rows and ``S`` columns) into columns
    ``start:start + S`` of ``rows`` of ``cache`` (one :func:`add_rows` takes), in place. False, and nothing written,
    where ``src``'s layers hold no plain keys and values."""
    layers = getattr(src, "layers", None)
    if not layers or len(layers) != len(cache.layers) or any(
            not isinstance(getattr(s, "keys", None), torch.Tensor) for s in layers):
        return False
    for la, s in zip(cache.layers, layers):
        k, v = (la._k, la._v) if type(la) is RoomyLayer else (la.keys, la.values)
        S = s.keys.shape[-2]
        k[rows, :, start:start + S], v[rows, :, start:start + S] = s.keys, s.values
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


#: The attention implementation :func:`grouped_heads_in_place` switches a model to while the engine samples.
IN_PLACE_GQA = "sdpa_gqa_in_place"
_in_place_ok: bool | None = None  # registered, and gives the copying path's result on this torch (checked once)


@contextlib.contextmanager
def grouped_heads_in_place(model: torch.nn.Module):
    """Within the block, a model on transformers' ``sdpa`` attention reads grouped-query key/value heads in place.

    With an attention mask (the engine's always has holes: padding, rows that sat a step out), transformers copies
    every key/value head once per query head that shares it (``repeat_kv``) before SDPA, in every layer at every
    step: a copy of the whole cache that takes longer than the attention itself on a small model. SDPA's
    ``enable_gqa`` reads the shared heads in place, as transformers already does when there is no mask; whether it
    gives the copy's result to the bit is checked once, and the model is left as it is if not (or on a GPU, where
    a mask with ``enable_gqa`` takes a slower kernel).
    """
    global _in_place_ok
    cfg = getattr(model, "config", None)
    use = (cfg is not None and getattr(cfg, "_attn_implementation", None) == "sdpa"
           and getattr(model, "device", torch.device("cpu")).type == "cpu")
    if use and _in_place_ok is None:
        _in_place_ok = _register_in_place()
    if not (use and _in_place_ok):
        yield
        return
    cfg._attn_implementation = IN_PLACE_GQA
    try:
        yield
    finally:
        cfg._attn_implementation = "sdpa"


def _sdpa_in_place(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """transformers' ``sdpa_attention_forward`` with a boolean mask and grouped heads, without the head copies."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is None or attention_mask.dtype != torch.bool or getattr(module, "num_key_value_groups", 1) == 1
            or kw.get("position_bias") is not None or query.device.type != "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kw)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register_in_place() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.integrations.sdpa_attention import repeat_kv
    except ImportError:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, n, 32, generator=g) for h, n in ((4, 7), (2, 40), (2, 40)))
    mask = torch.rand(5, 1, 7, 40, generator=g) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)
    if not torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), want):
        return False
    AttentionInterface.register(IN_PLACE_GQA, _sdpa_in_place)
    AttentionMaskInterface.register(IN_PLACE_GQA, sdpa_mask)  # the masks transformers makes for sdpa
    return True
