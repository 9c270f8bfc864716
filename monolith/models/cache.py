"""Caches, owned by the models that fill them, behind one small protocol: `snapshot()`
gives a restore point, `restore(snap)` goes back to it, and the hybrid cache's
`commit(snap, rows)` keeps only the first `rows` rows of the forward after a snapshot.
A speculative round calls nothing else.

The target's `HybridCache` (one per sequence) holds, per decoder layer, either a
`KVCache` (full attention: keys/values for up to max_context + spare rows, allocated as
rows are written) or a `GDNState`
(linear attention: the last K-1 pre-conv rows and the F32 recurrent state), and
`offset`, the number of committed rows. KV rows past `offset` are ignored and
overwritten, so going back costs nothing for attention. A GDN state cannot be rewound:
it is a function of every row it has consumed. A snapshot keeps references to the GDN
arrays (MLX arrays are immutable, so this copies nothing) and restoring puts them back
with their offset. A forward refuses to run while the GDN states and the offset
disagree, so a forgotten restore fails loudly instead of decoding from a wrong state.

Commit by replay (docs/drafts.md 4.5): `snapshot(record=True)` makes the next forward keep,
per GDN layer, a tape (the conv window and the per-row q, k, v, gamma, beta), and
`commit(snap, rows)` rebuilds the states after exactly the first `rows` rows of that
forward from the snapshot, without rerunning the model (all rows: the forward's own
states, no replay); on the CPU the forward keeps the state after every row, and the
commit takes the one after the kept rows.

The draft's `DraftContext` holds the K/V of the committed context rows per draft layer;
its snapshot is its offset (rows past it are overwritten by the next append).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import gdn_replay

SPARE_ROWS = 8  # KV rows beyond max_context: room for one speculative verify block
GROWTH_ROWS = 256  # a KV cache's rows grow to a multiple of this


class CacheError(ValueError):
    """A forward does not fit the cache, or the cache was moved inconsistently."""


class KVCache:
    """Keys and values of one attention layer, [1, kv_heads, rows, head_dim], for up to
    `capacity` rows. The rows are allocated as they are written: a write past them grows
    both arrays to at least twice their rows (a multiple of GROWTH_ROWS, at most the
    capacity), so a sequence takes the memory of what it holds, not of the context it may
    reach, and growing copies each row a bounded number of times."""

    bits = None  # stored as computed (QuantizedKVCache: the bits a stored value takes)

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype):
        self.capacity = capacity
        self.keys = mx.zeros((1, kv_heads, 0, head_dim), dtype)
        self.values = mx.zeros((1, kv_heads, 0, head_dim), dtype)

    @property
    def allocated(self) -> int:
        """The rows allocated so far."""
        return self.keys.shape[2]

    @property
    def row_nbytes(self) -> int:
        """The bytes of one row of keys and values."""
        return 2 * sum(a.shape[1] * a.shape[3] * a.itemsize for a in parts(self.keys))

    @property
    def max_nbytes(self) -> int:
        """The bytes of keys and values at the capacity."""
        return self.capacity * self.row_nbytes

    @property
    def layout(self) -> tuple:
        """(kv heads, width, dtype) of the rows `rows` gives and `write` takes."""
        return self.keys.shape[1], self.keys.shape[3], self.keys.dtype

    def _reserve(self, end: int) -> None:
        """Allocate rows [0, end)."""
        rows = self.allocated
        if end <= rows:
            return
        if end > self.capacity:
            raise CacheError(f"rows up to {end} do not fit a KV cache of {self.capacity} rows")
        grown = min(self.capacity, -(-max(end, 2 * rows) // GROWTH_ROWS) * GROWTH_ROWS)
        self._grow(grown - rows)

    def _grow(self, rows: int) -> None:
        self.keys, self.values = padded(self.keys, rows), padded(self.values, rows)

    def update(self, keys: mx.array, values: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Write rows [offset, offset + T) and return all rows up to there."""
        end = offset + keys.shape[2]
        self._reserve(end)
        self.keys[:, :, offset:end] = keys
        self.values[:, :, offset:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def arrays(self) -> list[mx.array]:
        return [*parts(self.keys), *parts(self.values)]

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Copies of rows [start, end) (lazy): holding them never pins this cache's buffer,
        which would make every later update copy the whole buffer."""
        return mx.array(self.keys[:, :, start:end]), mx.array(self.values[:, :, start:end])

    def _check_rows(self, start: int, keys: mx.array) -> int:
        """The end of rows `keys` (from `rows`) written at `start`; CacheError unless they fit."""
        end = start + keys.shape[2]
        heads, width, dtype = self.layout
        if end > self.capacity or (keys.shape[1], keys.shape[3]) != (heads, width) \
                or (dtype == mx.uint32) != (keys.dtype == mx.uint32):
            bits = f"{self.bits}-bit quantized " if self.bits else ""
            raise CacheError(f"rows {keys.dtype}{list(keys.shape)} at {start} do not fit a {bits}KV cache of "
                             f"{self.capacity} rows of {heads} heads x {width} {dtype}")
        self._reserve(end)
        return end

    def write(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Put rows (from `rows`) back at [start, start + T)."""
        end = self._check_rows(start, keys)
        self.keys[:, :, start:end] = keys.astype(self.keys.dtype)
        self.values[:, :, start:end] = values.astype(self.values.dtype)


def parts(stored) -> tuple:
    """The arrays one side (keys or values) of a KV cache is stored in."""
    return stored if isinstance(stored, tuple) else (stored,)


def padded(a: mx.array, rows: int) -> mx.array:
    """`a` [1, heads, R, width] with `rows` zero rows more."""
    _, heads, _, width = a.shape
    return mx.concatenate([a, mx.zeros((1, heads, rows, width), a.dtype)], axis=2)


@dataclass(frozen=True)
class GDNTape:
    """One GDN layer's inputs over the rows of a forward: window [1, K-1+T, C] (the
    previous conv state then the new pre-conv rows, F32) and the recurrence inputs
    q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], gamma, beta [1, T, Hv] (F32); on the CPU also
    the recurrent state after every row, states [1, T, Hv, Dv, Dk] (F32: the CPU pays per
    primitive, so a slice of these beats a replay)."""

    window: mx.array
    q: mx.array
    k: mx.array
    v: mx.array
    gamma: mx.array
    beta: mx.array
    states: mx.array | None = None

    def replay(self, conv_rows: int, recurrent: mx.array, rows: int) -> tuple[mx.array, mx.array]:
        """(conv, recurrent) after the first `rows` rows, from the recurrent state before them."""
        if self.states is None:
            return gdn_replay(self.window, self.k, self.v, self.gamma, self.beta, recurrent, rows, conv_rows)
        if not 0 <= rows <= self.states.shape[1]:
            raise CacheError(f"cannot keep {rows} rows of a {self.states.shape[1]}-row tape")
        conv = self.window[:, rows:rows + conv_rows]
        return conv, recurrent if rows == 0 else self.states[:, rows - 1]


class GDNState:
    """One gated DeltaNet layer: conv [1, K-1, conv_dim] (the last K-1 pre-conv rows,
    F32) and recurrent [1, Hv, Dv, Dk] (F32, MLX's layout: transposed against Hugging
    Face's [Hv, Dk, Dv]); `tape` holds the latest forward's inputs while recording."""

    def __init__(self, conv_dim: int, kernel: int, value_heads: int, value_dim: int, key_dim: int):
        self.conv = mx.zeros((1, kernel - 1, conv_dim), mx.float32)
        self.recurrent = mx.zeros((1, value_heads, value_dim, key_dim), mx.float32)
        self.record = False
        self.tape: GDNTape | None = None

    def arrays(self) -> list[mx.array]:
        return [self.conv, self.recurrent]

    @property
    def max_nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


PLAIN = (0, None, 0)  # the positions of a cache that holds only text


@dataclass(frozen=True)
class Snapshot:
    """GDN states (conv, recurrent) per linear-attention layer, in layer order, valid
    after exactly `offset` rows, and the cache's multimodal positions there
    (position_delta, plain_until, delta_from; PLAIN for text only)."""

    offset: int
    states: tuple[tuple[mx.array, mx.array], ...]
    positions: tuple[int, int | None, int] = PLAIN


class HybridCache:
    def __init__(self, layers: list[KVCache | GDNState], max_context: int, spare_rows: int = SPARE_ROWS):
        self.layers = layers
        self.max_context = max_context
        self.spare_rows = spare_rows
        self.capacity = max_context + spare_rows
        self.offset = 0  # committed rows (attention positions)
        self.state_offset = 0  # rows the GDN states have consumed
        self.written = 0  # KV rows [0, written) hold the rows of the latest forward
        self.tape_offset: int | None = None  # where the recorded forward started
        self._gdn = [layer for layer in layers if isinstance(layer, GDNState)]
        self._recording = False  # the next forward keeps its tapes
        # multimodal positions (docs/target.md, "Images in the forward"): row i >= delta_from
        # sits at rotary position i + position_delta; rows before plain_until at i
        self.position_delta = 0
        self.plain_until: int | None = None  # None: every row so far is plain text
        self.delta_from = 0

    def _record(self, on: bool) -> None:
        if on or self._recording:
            for layer in self._gdn:
                layer.record, layer.tape = on, None
        self._recording = on

    def __repr__(self) -> str:
        return (f"HybridCache(offset={self.offset}, max_context={self.max_context}, "
                f"{len(self.layers) - len(self._gdn)} attention + {len(self._gdn)} linear layers)")

    def check(self, rows: int, limit: int | None = None) -> None:
        """Raise before any work unless `rows` more rows fit (in `limit`, default the
        capacity: max_context + spare rows) and the GDN states match the offset."""
        limit = self.capacity if limit is None else limit
        if self.offset + rows > limit:
            spare = f" (+{self.spare_rows} spare rows)" if limit == self.capacity else ""
            raise CacheError(
                f"{rows} rows at offset {self.offset} need {self.offset + rows} positions, "
                f"but the cache holds max_context={self.max_context}{spare}"
            )
        if self._gdn and self.state_offset != self.offset:
            raise CacheError(
                f"the cache offset is {self.offset} but the gated DeltaNet states hold {self.state_offset} rows: "
                "after rewind(), restore() a snapshot taken at that offset"
            )

    def advance(self, rows: int, position_delta: int | None = None) -> None:
        """Called by the model after laying out a forward of `rows` rows; `position_delta`
        when they had explicit multimodal positions: the rows after them continue at
        index + position_delta."""
        if position_delta is not None:
            if self.plain_until is None:
                self.plain_until = self.offset
            self.position_delta, self.delta_from = position_delta, self.offset + rows
        self.tape_offset = self.offset if self._recording else None
        if self._recording:  # only the forward after snapshot(record=True) keeps tapes
            for layer in self._gdn:
                layer.record = False
            self._recording = False
        elif any(layer.tape is not None for layer in self._gdn[:1]):
            for layer in self._gdn:
                layer.tape = None
        self.offset += rows
        self.state_offset = self.written = self.offset

    def rewind(self, offset: int) -> None:
        """Move the attention caches back to `offset` committed rows (GDN states are not
        touched: restore a snapshot for them)."""
        if not 0 <= offset <= self.offset:
            raise CacheError(f"cannot rewind to {offset}: the cache holds {self.offset} rows")
        self._positions_at(offset)
        self.offset = offset

    def _positions_at(self, offset: int) -> None:
        """Going back to `offset` rows: the position delta stays past the last forward with
        multimodal positions and is 0 before the first; in between it is not known."""
        if self.plain_until is None or offset >= self.delta_from:
            return
        if offset > self.plain_until:
            raise CacheError(f"cannot go back to {offset} rows: inside the rows [{self.plain_until}, "
                             f"{self.delta_from}) laid out with multimodal positions")
        self.position_delta, self.plain_until, self.delta_from = 0, None, 0

    def snapshot(self, record: bool = False) -> Snapshot:
        """The states after the committed rows; with `record`, the next forward keeps
        the tapes `commit` replays (they cost ~0.5 ms a step on the CPU: only a
        speculative verify asks for them)."""
        self._record(record)
        return Snapshot(self.state_offset, tuple((s.conv, s.recurrent) for s in self._gdn), self.positions)

    @property
    def positions(self) -> tuple[int, int | None, int]:
        """(position_delta, plain_until, delta_from), as a snapshot keeps them."""
        return self.position_delta, self.plain_until, self.delta_from

    def restore(self, snap: Snapshot) -> None:
        """Put back the GDN states of `snap` and set the offset to snap.offset, which may
        lie past a rewind as long as the latest forward wrote those KV rows."""
        if len(snap.states) != len(self._gdn):
            raise CacheError(f"snapshot has {len(snap.states)} GDN states, the cache has {len(self._gdn)}")
        if snap.offset > self.written:
            raise CacheError(f"snapshot at offset {snap.offset} is ahead of the KV rows written ({self.written})")
        before = self.positions
        self.position_delta, self.plain_until, self.delta_from = snap.positions
        try:
            self._positions_at(snap.offset)
        except CacheError:
            self.position_delta, self.plain_until, self.delta_from = before
            raise
        for layer, (conv, recurrent) in zip(self._gdn, snap.states):
            layer.conv, layer.recurrent = conv, recurrent
        self.offset = self.state_offset = snap.offset
        self._record(False)

    def commit(self, snap: Snapshot, rows: int) -> None:
        """Keep only the first `rows` rows of the latest forward, which started at
        snap.offset (after `snapshot(record=True)`): GDN states replayed from `snap` over
        those rows, offset after them. All its rows: nothing to replay."""
        if not 0 <= rows <= self.written - snap.offset:
            raise CacheError(f"cannot keep {rows} rows of a {self.written - snap.offset}-row forward")
        if rows == self.written - snap.offset and self.offset == self.written:
            return
        if self.tape_offset is None or self.tape_offset != snap.offset:
            raise CacheError(f"commit needs a recorded forward starting at the snapshot's offset {snap.offset} "
                             f"(recorded: {self.tape_offset}); take the snapshot with record=True")
        states = tuple(layer.tape.replay(conv.shape[1], recurrent, rows)
                       for layer, (conv, recurrent) in zip(self._gdn, snap.states))
        self.restore(Snapshot(snap.offset + rows, states, self.positions))

    def arrays(self) -> list[mx.array]:
        """Every state array (to mx.eval between prefill chunks)."""
        return [a for layer in self.layers for a in layer.arrays()]

    @property
    def row_layers(self) -> list[KVCache]:
        """The attention layers' KV caches, whose rows a prompt cache copies out and back."""
        return [layer for layer in self.layers if isinstance(layer, KVCache)]

    def adopt(self, snap: Snapshot) -> None:
        """The KV rows [0, snap.offset) were just written (`KVCache.write`): take snap's GDN
        states there."""
        if snap.offset > self.max_context:
            raise CacheError(f"a snapshot at {snap.offset} rows does not fit max_context={self.max_context}")
        self.written = snap.offset
        self.restore(snap)


class DraftContext:
    """Per draft layer, K/V of the committed context rows in a `KVCache` of max_context +
    block_size rows; `offset` = committed rows. The rows from offset
    on are the running proposal's scratch space."""

    def __init__(self, layers: list[KVCache], max_context: int):
        self.layers = layers
        self.max_context = max_context
        self.offset = 0

    def __repr__(self) -> str:
        return f"DraftContext(offset={self.offset}, max_context={self.max_context})"

    def snapshot(self) -> int:
        return self.offset

    def restore(self, offset: int) -> None:
        """Back to `offset` committed rows (a snapshot taken then)."""
        if not 0 <= offset <= self.offset:
            raise CacheError(f"can only restore the draft context to [0, {self.offset}] rows, got {offset}")
        self.offset = offset

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]

    @property
    def row_layers(self) -> list[KVCache]:
        return self.layers

    def adopt(self, offset: int) -> None:
        """The rows [0, offset) were just written (`KVCache.write`)."""
        if not 0 <= offset <= self.max_context:
            raise CacheError(f"cannot hold {offset} rows in a draft context of max_context={self.max_context}")
        self.offset = offset
