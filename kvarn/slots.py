"""Slot caches for the fp16 and affine baselines: one fused attention per layer over all rows.

Per layer, one ``SlotStore`` holds every row's keys and values in shared buffers, one slot per
row; a row keeps its own token positions, and a batch of decoding rows reads all its slots at
once (one ``mx.fast.scaled_dot_product_attention`` per layer, or for affine mlx-lm's quantized
attention, under one validity mask):

    SlotStore (one layer)   buffers [num_slots, H, T_cap, D]  (affine: codes, scales, biases)
                             token 0                                          T_cap
      slot 0   row A  cap 330  [##########################.........|      ]   offset 300
      slot 1   row B  cap 170  [############......|                      ]   offset 130
      slot 2   row C  cap  45  [###.....|                                ]   offset   5
      slot 3   (free)          [                                         ]
                                ##: written   ..: reserved up to |capacity

    SlotBatch [A, B, C] (slots 0..2, consecutive in batch order), one decode step
    (``kvarn.slot_step``):
      write   buf[[0, 1, 2], :, [300, 130, 5]] = keys[:, :, 0]       one scatter per buffer (over its
              flat [S*H*T_cap, D] view, at row indices made once a step for all layers)
      read    buf[0:3, :, :T]      T = 301 (max offset after the write): a view, no copy
      mask    [3, 1, 1, T]         True where position < the row's offset after the write

Invariants:
- a live row owns exactly one slot and holds at most ``capacity`` tokens (its reservation:
  prompt + max_tokens); tokens ``[0, offset)`` of its slot are its history, the rest is stale
  or zero and always masked;
- buffers are allocated at the first write (H, D, dtype from it). They grow, by copy, only when
  a new row finds every slot taken (slots double, and T_cap becomes what the live rows and the
  new one need, rounded up to ``token_step``) or asks for more than T_cap tokens (T_cap grows
  to its capacity rounded up). Every other write (prefill chunks, decode
  scatters) is an in-place update MLX donates: the store holds the only reference to a buffer
  and hands out slices only. A slice kept across a later write makes that write copy the whole
  buffer (correct, slow): drop what ``update_and_fetch`` returned once attention has run;
- a decoding batch reads its slots as one plain slice, so they must be consecutive in batch
  order. Rows never move on release (a released slot is just free) nor on join; at the first
  batch step after its rows changed, the store makes them consecutive copying the fewest
  tokens (``SlotStore._place``; a moved row's ``offset`` tokens are copied once). A row that
  leaves at either end costs nothing; one that leaves the middle shifts the side holding fewer
  tokens by one slot. New rows take the lowest free slot after the batch's window, so a row
  joining at the end usually lands in place;
- the store owns its rows and updates a row's slot when it moves it: hold rows, never slots.
  ``release()`` is required (the store keeps a row alive until then).

Only plain full-attention layers (mlx-lm ``KVCache``) use slots, as ``kvarn.rows`` decides.
``SlotBatch`` is no ``kvarn.batch.BatchRows``: every decode token is written and attended by the
slots' one decode step (``kvarn.slot_step``: planned for every layer at once, or one layer at a
time by a model run through the batch itself), which attends all rows at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from kvarn.slot_step import SlotStepLayer, slot_write
from kvarn.step_context import step_of

Leg = mx.array | tuple[mx.array, ...]  # fp16: one array; affine: (codes, scales, biases)


class SlotStore:
    """One layer's slots. ``bits=None``: keys and values as written (the compute dtype);
    ``bits``: mlx-lm ``QuantizedKVCache``'s affine (codes, scales, biases) per leg."""

    def __init__(self, bits: int | None = None, group_size: int = 64, *, slots: int = 4,
                 token_step: int = 256) -> None:
        if slots < 1 or token_step < 1:
            raise ValueError("a store needs at least one slot and a positive token step")
        self.bits = bits
        self.group_size = group_size
        self.token_step = token_step
        self._initial_slots = slots
        self._rows: list[SlotRow | None] = [None] * slots  # slot -> its row
        self._tokens = 0  # T_cap
        self._buffers: list[mx.array] = []  # keys parts, then values parts; empty until written
        self._window_end = 0  # end of the last batch window: new rows go after it

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def num_slots(self) -> int:
        return len(self._rows)

    @property
    def token_capacity(self) -> int:
        """T_cap: token positions per slot (the largest capacity asked for, rounded up)."""
        return self._tokens

    @property
    def live_slots(self) -> list[int]:
        return [slot for slot, row in enumerate(self._rows) if row is not None]

    @property
    def nbytes(self) -> int:
        """The buffers' bytes: every slot at T_cap tokens (>= the sum of the rows' reservations)."""
        return sum(buf.nbytes for buf in self._buffers)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one row (keys and values); 0 until the first write."""
        return sum(buf.shape[1] * buf.shape[3] * buf.itemsize for buf in self._buffers)

    def new_row(self, capacity: int) -> SlotRow:
        """A row for up to ``capacity`` tokens, in the lowest free slot after the last batch
        window (else the lowest free slot; slots double when all are taken)."""
        if capacity < 1:
            raise ValueError(f"a row needs a positive capacity, not {capacity}")
        if all(row is None for row in self._rows):  # an idle store: the next batch starts at slot 0
            self._window_end = 0  # again, where the last one did (its step's graph is specialised on it)
        tokens = self._rounded(capacity)
        slot = self._free_slot(start=self._window_end, tokens=tokens)
        if tokens > self._tokens:
            self._resize(tokens=tokens)
        row = SlotRow(self, slot, capacity)
        self._rows[slot] = row
        return row

    def shrink(self) -> int:
        """With no live row, give the buffers back (the next row allocates them again at its
        first write, as at start); returns the bytes released. Buffers grow by copy and never
        shrink otherwise: after a burst of rows they would keep its high-water mark. The engine
        calls this when it goes idle (``Engine.release_idle_memory``)."""
        if any(row is not None for row in self._rows):
            return 0
        released = self.nbytes
        self._buffers = []
        self._rows = [None] * self._initial_slots
        self._tokens = 0
        self._window_end = 0
        return released

    # --- buffers ---

    def _encode(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        """What a slot stores for these tokens: the arrays, or their affine triples."""
        if self.bits is None:
            return [keys, values]
        return [*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits)]

    def _parts(self, keys: Leg, values: Leg) -> list[mx.array]:
        return [keys, values] if self.bits is None else [*keys, *values]

    def _legs(self, parts: list[mx.array]) -> tuple[Leg, Leg]:
        if self.bits is None:
            return parts[0], parts[1]
        return tuple(parts[:3]), tuple(parts[3:])

    def _allocate(self, parts: list[mx.array]) -> None:
        """Buffers for every slot at T_cap, shaped after the first arrays written."""
        if not self._buffers:
            self._buffers = [mx.zeros((self.num_slots, p.shape[1], self._tokens, p.shape[3]), p.dtype)
                             for p in parts]

    def _rounded(self, capacity: int) -> int:
        return -(-capacity // self.token_step) * self.token_step

    def _resize(self, slots: int | None = None, tokens: int | None = None) -> None:
        """Grow (copy) to ``slots`` slots and/or at least ``tokens`` positions per slot. Growing
        slots copies every buffer anyway, so T_cap then also drops to what the live rows and
        ``tokens`` need: a long request that has finished leaves no wide slots behind for the
        burst of short ones that outgrows them (16 rows after one of 3,000 tokens took 4.3 s
        instead of 0.8 s on this project's CPU, copying and faulting in ~900 MB)."""
        grow_slots = max((slots or 0) - self.num_slots, 0)
        new_tokens = max(tokens or 0, self._tokens)
        if grow_slots:
            live = [self._rounded(row.capacity) for row in self._rows if row is not None]
            new_tokens = max([tokens or 0, *live])
        self._rows += [None] * grow_slots
        if self._buffers and (grow_slots or new_tokens != self._tokens):
            kept = [buf[:, :, :new_tokens] if new_tokens < self._tokens else buf for buf in self._buffers]
            pad = [(0, grow_slots), (0, 0), (0, max(new_tokens - self._tokens, 0)), (0, 0)]
            self._buffers = [mx.pad(buf, pad) for buf in kept]
        self._tokens = new_tokens

    def _write(self, slot: int, start: int, parts: list[mx.array]) -> None:
        """Tokens [start, start + L) of ``slot`` (an in-place slice update of each buffer)."""
        self._allocate(parts)
        for buf, part in zip(self._buffers, parts, strict=True):
            buf[slot: slot + 1, :, start: start + part.shape[2]] = part

    def _read(self, lo: int, hi: int, tokens: int) -> list[mx.array]:
        return [buf[lo:hi, :, :tokens] for buf in self._buffers]

    # --- slots ---

    def _free_slot(self, start: int = 0, exclude: range = range(0), tokens: int = 0) -> int:
        """The lowest free slot at or after ``start`` (else the lowest) outside ``exclude``;
        doubles the slots when none is free (with at least ``tokens`` positions each)."""
        free = [slot for slot, row in enumerate(self._rows) if row is None and slot not in exclude]
        if not free:
            slot = self.num_slots
            self._resize(slots=2 * self.num_slots, tokens=tokens)
            return slot
        return next((slot for slot in free if slot >= start), free[0])

    def _release(self, row: SlotRow) -> None:
        self._rows[row.slot] = None

    def _copy_out(self, row: SlotRow) -> list[mx.array]:
        """A row's tokens [0, offset) copied out of the buffers and evaluated, so that writing
        them back into a slot updates the buffers in place (a lazy copy would still read from
        them, and MLX copies a buffer that is read while written)."""
        if not (row.offset and self._buffers):
            return []
        data = [mx.array(buf[row.slot: row.slot + 1, :, : row.offset]) for buf in self._buffers]
        mx.eval(data)
        return data

    def _lift(self, row: SlotRow) -> list[mx.array]:
        """Copy a row's tokens out and free its slot; the row has no slot until ``_put``."""
        data = self._copy_out(row)
        self._rows[row.slot] = None
        return data

    def _put(self, row: SlotRow, slot: int, data: list[mx.array]) -> None:
        if data:
            self._write(slot, 0, data)
        self._rows[slot] = row
        row._slot = slot

    def _fork(self, row: SlotRow) -> SlotRow:
        child = self.new_row(row.capacity)
        self._put(child, child.slot, self._copy_out(row))
        child.offset = row.offset
        return child

    def _place(self, rows: Sequence[SlotRow]) -> int:
        """Make ``rows`` occupy consecutive slots in their order; returns the first slot.

        Of the windows [lo, lo + B) within the current slots, the one that copies least wins
        (the lowest on a tie): each row not yet in place, and each other row inside the window,
        costs its tokens + 1. Rows from outside the window move in first (each chain of
        displaced rows ends at a free slot or at another row, which goes to a free slot outside
        the window: such a chain has just freed one), then rows permuted inside it (cycles).
        At most two rows are out of the store at a time."""
        B = len(rows)
        slots = [row.slot for row in rows]
        if slots == list(range(slots[0], slots[0] + B)):
            self._window_end = slots[0] + B
            return slots[0]
        members = {id(row) for row in rows}
        in_place: dict[int, int] = {}  # lo -> weight of the rows already in place for it
        for b, row in enumerate(rows):
            in_place[row.slot - b] = in_place.get(row.slot - b, 0) + row.offset + 1
        others = [0]  # prefix sums of the other rows' weights, by slot
        for row in self._rows:
            others.append(others[-1] + (row.offset + 1 if row is not None and id(row) not in members else 0))
        total = sum(row.offset + 1 for row in rows)
        lo = min(range(self.num_slots - B + 1),
                 key=lambda lo: total - in_place.get(lo, 0) + others[lo + B] - others[lo])
        window = range(lo, lo + B)
        target = {id(row): lo + b for b, row in enumerate(rows)}
        for row in [r for r in rows if r.slot not in window] + [r for r in rows if r.slot in window]:
            if row.slot == target[id(row)]:
                continue
            carry, data, slot = row, self._lift(row), target[id(row)]
            while True:
                occupant = self._rows[slot]
                displaced = None if occupant is None else (occupant, self._lift(occupant))
                self._put(carry, slot, data)
                if displaced is None:
                    break
                carry, data = displaced
                if id(carry) not in target:
                    self._put(carry, self._free_slot(exclude=window), data)
                    break
                slot = target[id(carry)]
        self._window_end = lo + B
        return lo


class SlotRow(_BaseCache):
    """One row's cache in one layer: mlx-lm's cache protocol over the row's slot, so a model
    runs the row's prompt chunks through it unmodified (returns like ``KVCache``, or for affine
    like ``QuantizedKVCache``, with ``group_size``/``bits`` so mlx-lm's quantized attention runs).
    Made by ``SlotStore.new_row``; unusable after ``release``."""

    def __init__(self, store: SlotStore, slot: int, capacity: int) -> None:
        self.store = store
        self.capacity = capacity
        self.offset = 0
        self._slot: int | None = slot
        if store.quantized:
            self.group_size, self.bits = store.group_size, store.bits

    @property
    def slot(self) -> int:
        if self._slot is None:
            raise RuntimeError("this row was released")
        return self._slot

    @property
    def released(self) -> bool:
        return self._slot is None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Leg, Leg]:
        """Write tokens [offset, offset + L) of keys/values [1, H, L, D]; return the row's
        history [1, H, offset, D] (views of the store's buffers)."""
        if keys.shape[0] != 1:
            raise ValueError(f"a row takes one sequence, not {keys.shape[0]}")
        self._check_room(keys.shape[2])
        self.store._write(self.slot, self.offset, self.store._encode(keys, values))
        self.offset += keys.shape[2]
        return self.fetch()

    def fetch(self) -> tuple[Leg, Leg]:
        """The row's history [1, H, offset, D] as the buffers hold it now (views, valid until
        the next write to the store)."""
        return self.store._legs(self.store._read(self.slot, self.slot + 1, self.offset))

    def load(self, keys: Leg, values: Leg, offset: int | None = None) -> None:
        """Write stored arrays [1, H, n, ...] (affine: the triples) at [0, n); the row then holds
        ``offset`` tokens (default n). For restoring a row from cached blocks or a snapshot."""
        parts = self.store._parts(keys, values)
        n = parts[0].shape[2]
        offset = n if offset is None else offset
        if not 0 <= offset <= n:
            raise ValueError(f"offset {offset} outside the {n} tokens loaded")
        if n > self.capacity:
            raise ValueError(f"{n} tokens do not fit a row of capacity {self.capacity}")
        self.store._write(self.slot, 0, parts)
        self.offset = offset

    def _check_room(self, tokens: int) -> None:
        if self.offset + tokens > self.capacity:
            raise ValueError(f"row of capacity {self.capacity} holds {self.offset} tokens, "
                             f"cannot take {tokens} more")

    @property
    def keys(self) -> Leg | None:
        """The row's slot over its capacity [1, H, capacity, D] (None before the store's first
        write): a view, valid until the next write to the store."""
        return self._view()[0]

    @property
    def values(self) -> Leg | None:
        return self._view()[1]

    def _view(self) -> tuple[Leg | None, Leg | None]:
        if not self.store._buffers:
            return None, None
        return self.store._legs(self.store._read(self.slot, self.slot + 1, self.capacity))

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """The row's reservation: ``capacity`` tokens (what ``FP16KVCache``/``AffineKVCache`` of
        that capacity report once written); 0 until the store's first write."""
        return self.capacity * self.store.token_bytes

    @property
    def state(self) -> list[Leg]:
        """[keys, values] of the row's ``offset`` tokens, like ``KVCache``."""
        parts = self.store._read(self.slot, self.slot + 1, self.offset)
        return list(self.store._legs(parts))

    @state.setter
    def state(self, v: Sequence[Leg]) -> None:
        keys, values = v
        self.load(keys, values)

    @property
    def meta_state(self) -> tuple[str, str]:
        return str(self.capacity), str(self.offset)

    def fork(self) -> SlotRow:
        """A new row (its own slot, same capacity) holding a copy of this row's tokens."""
        return self.store._fork(self)

    def release(self) -> None:
        """Free the slot (no copy). Idempotent; the row must not be used afterwards."""
        if self._slot is not None:
            self.store._release(self)
            self._slot = None


class SlotBatch(_BaseCache):
    """The decoding rows of one layer (all of one store), in batch order: one decode step writes
    every row's token at its own position and attends over all rows at once.

    ``offset`` is the per-row offsets (int32), which mlx-lm passes to ``mx.fast.rope`` as is.
    Rows join (``extend``) and leave (``filter``) as they are; the next step makes their slots
    consecutive (see the module docstring). Affine batches carry ``group_size``/``bits``."""

    def __init__(self, rows: Iterable[SlotRow]) -> None:
        rows = list(rows)
        if not rows:
            raise ValueError("a SlotBatch starts with at least one row (its store comes from them)")
        self.store = rows[0].store
        if self.store.quantized:
            self.group_size, self.bits = self.store.group_size, self.store.bits
        self.rows: list[SlotRow] = []
        self.decoding: SlotStepLayer | None = None  # this step's layer, for its attention
        self.extend(rows)

    def extend(self, rows: Iterable[SlotRow]) -> None:
        """Rows join at the end of the batch."""
        for row in rows:
            if not isinstance(row, SlotRow) or row.store is not self.store:
                raise TypeError("a SlotBatch takes rows of its own store")
            if row.released or any(row is other for other in self.rows):
                raise ValueError("a released row, or one already in the batch")
            self.rows.append(row)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices into the current rows, in the new order)."""
        if len(set(keep)) != len(keep):
            raise ValueError(f"rows kept twice: {list(keep)}")
        self.rows = [self.rows[i] for i in keep]
        self.decoding = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def offset(self) -> mx.array:
        """The rows' offsets at the step's start as one int32 array, made once a forward (its
        ``StepContext``): every layer's batch (and both of a layer's RoPE calls, and the mask)
        asks before its own write, with the same offsets."""
        return step_of(self).get("slot_offsets", lambda: mx.array([row.offset for row in self.rows], dtype=mx.int32))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Leg, Leg]:
        """keys/values [B, H, 1, D]: row b's token at its own offset, through the slots' decode
        step (``kvarn.slot_step.slot_write``); returns the batch's slots [B, H, T, D] with T = the
        largest offset after the write (one slice per buffer)."""
        self.decoding, fetched = slot_write(self, keys, values)
        return fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """[B, 1, 1, T] booleans, True where a position is below the row's offset after this
        step's write (T = the largest of those offsets). Decode only, full attention only."""
        if N != 1 or window_size is not None:
            raise ValueError("a SlotBatch decodes one token per row over full attention")
        lengths = self.offset + 1
        tokens = max(row.offset for row in self.rows) + 1
        return (mx.arange(tokens)[None] < lengths[:, None]).reshape(len(self.rows), 1, 1, tokens)

    def size(self) -> int:
        return max((row.offset for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def attend(self, queries: mx.array, keys: Leg, values: Leg, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        """Every row at once: the step's attention (``kvarn.slot_step.SlotStepLayer.attend``)."""
        if self.decoding is None:
            raise RuntimeError("slot batch attention before update_and_fetch")
        return self.decoding.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks, dispatch=dispatch,
                                    default=default)
