"""The per-step plan: what one engine forward runs, handed to the model in place of a cache.

The tokens of every sequence in a step are laid out flat, ``[1, N]``, so the projections and
MLPs run once over all of them (no padding between a 300-token prompt chunk and a one-token
decode). The plan knows where each token's K/V goes (its sequence's slot) and which keys each
query may see, and is the cache view the models attend through (``attend``, cache/view.py). Attention runs per *group*: every sequence with one generated query this step
(decodes) in one batched call, each prompt chunk in its own call (one of a single token too: a
prompt row attends as the prompt's other chunks do, so a prompt's bits never depend on where its
chunks or its cached prefix end).
A query at position p of a sequence sees that sequence's slots for positions 0..p only (and,
on a sliding-window layer, only the last ``window`` of them), so a result never depends on
what else is in the step. Nothing about the step is stored on the cache object.

The plan also carries the step's ``Products`` (layers/products.py): which of its flat tokens are
prompt rows and the thread budget. The model hands them to every product and the plan attends
with them, so nothing outside the plan decides a row's arithmetic.

The cache is layered (engine/slots.py): a full layer reads its kind's blocks from position 0, a
sliding layer only the blocks of its window in its own kind (``window_tables``: a table per
group starting at the first block its queries can see, with that block's first position), so
each group carries one table per kind and a mask per window built from the key positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..layers.attention import attention, paged_attention, paged_attention_runs, position_mask
from ..layers.products import Products
from .fastseq import shared_prefix_attention
from .slots import SlotCache, first_visible_block


@dataclass
class AttentionGroup:
    """Rows attending with the same number of queries: flat tokens [first, first + rows * queries)."""

    first: int
    rows: int
    queries: int
    block_table: torch.Tensor  # [rows, n]: keys are positions 0..n*block-1 (past a row's end: masked)
    query_positions: torch.Tensor  # [rows, queries]
    # Each sliding kind's view: window -> (tables [rows, m] from the first visible block, position of
    # each row's first key [rows, 1]).
    window_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # FastSeq: each run of ``fold`` rows (a sample's beams) shares its first ``shared_blocks`` blocks,
    # whose keys are then read once per run (engine/fastseq.py). 0: nothing shared.
    fold: int = 1
    shared_blocks: int = 0
    # The same for each sliding kind: its tables then start at the group's earliest visible block.
    window_shared: dict[int, int] = field(default_factory=dict)
    # A one-token prompt chunk: a prompt row, attending as the prompt's other chunks (never the paged op).
    prompt: bool = False


def layer_windows(config) -> list[int | None]:
    """The sliding window of each layer (None: full attention). Part of each layer's mask, so a
    model whose layers differ (local / global) is served as it is (``ModelConfig.layer_types``)."""
    return list(config.layer_windows)


def attention_terms(model) -> tuple[list[int | None], Callable | None]:
    """(each layer's window, the model's position bias or None) a plan masks attention with."""
    cfg = model.config
    return layer_windows(cfg), (model.alibi_bias if cfg.position_kind == "alibi" else None)


class StepPlan:
    def __init__(self, cache: SlotCache, write_slots: dict[int | None, torch.Tensor], groups: list[AttentionGroup],
                 windows: list[int | None], score_bias: Callable[[torch.Tensor], torch.Tensor] | None,
                 dtype: torch.dtype, products: Products, write_starts: dict[int | None, int] | None = None):
        self.cache = cache
        self.products = products  # the flat tokens' roles and the step's thread budget
        self.write_slots = write_slots  # kind (None: full, else the window) -> [N] slot of each flat token
        # kind -> s where the flat tokens' slots are s, s + 1, ... (one prompt chunk): written with one copy
        self.write_starts = write_starts or {}
        self.groups = groups
        self.windows = windows
        self.score_bias = score_bias  # ALiBi: distances [B, T, S] -> bias [B, H, T, S]
        self.dtype = dtype
        self._masks: dict[tuple, object] = {}  # per-step masks, paged rows and biases, built once

    @classmethod
    def for_rows(cls, cache: SlotCache, rows: list[tuple[list[int], int, int]], windows: list[int | None],
                 score_bias: Callable | None, dtype: torch.dtype, products: Products,
                 shared: tuple[int, int] = (1, 0), runs: dict[int, tuple[int, int]] | None = None) -> "StepPlan":
        """The plan of one forward over ``rows``: (block table, first position, token count) per
        sequence, in the order its tokens are laid out flat (the caller made the tokens writable:
        ``SlotCache.prepare``). Consecutive one-token generated rows attend as one group; every prompt
        chunk (one prompt token too) is a group of its own. ``shared`` (fold, blocks): in the one-token groups, each run of
        ``fold`` rows holds the same first ``blocks`` full-kind blocks (the caller guarantees it:
        beams of a sample over its prompt). ``runs``: first row -> (fold, blocks) of one-token rows
        that form a group of their own, folded the same way (a beam group among other rows).
        ``products``: the flat tokens' roles and the thread budget."""
        device = cache.keys.device
        kinds = [None, *cache.windows]
        slots: dict[int | None, list[int]] = {kind: [] for kind in kinds}
        runs = runs or {}
        starts = list(itertools.accumulate((row[2] for row in rows), initial=0))  # each row's first flat token
        prompt_token = products.is_prompt_row
        groups, first, end = [], 0, 0
        for index, (table, start, count) in enumerate(rows):
            for kind in kinds:
                slots[kind] += cache.slot_ids(table, start, start + count, kind)
            if index < end:
                continue  # already in the group it belongs to
            alone = count > 1 or prompt_token(starts[index])  # a chunk (of one token too) is a group of its own
            if index in runs:
                fold, shared_blocks = runs[index]
                run = rows[index : index + fold]
            elif not alone:
                run = [row for i, row in itertools.takewhile(
                    lambda item: item[1][2] == 1 and item[0] not in runs and not prompt_token(starts[item[0]]),
                    enumerate(rows[index:], index))]
                fold, shared_blocks = shared if len(run) % shared[0] == 0 else (1, 0)
            else:
                run, fold, shared_blocks = [rows[index]], 1, 0
            end = index + len(run)
            group = attention_group(cache, first, run, fold, shared_blocks)
            group.prompt = count == 1 and alone and index not in runs
            groups.append(group)
            first += sum(row[2] for row in run)
        write_slots = {kind: torch.tensor(s, dtype=torch.long, device=device) for kind, s in slots.items()}
        write_starts = {kind: s[0] for kind, s in slots.items() if s and s == list(range(s[0], s[0] + len(s)))}
        return cls(cache, write_slots, groups, windows, score_bias, dtype, products, write_starts)


    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """q [1, H, N, D]; k, v [1, Hkv, N, D]: write k, v into the sequences' slots of the layer's
        kind, then attend each group over its own slots, masked from the plan's own layout -> [1, H, N, D].
        One-query groups (decodes) run the C++ paged attention where it is built (``layers/attention.py``): the whole step in one op when every group is one. The op
        has no soft-capping: with ``softcap`` every group gathers and runs ``attention``."""
        # The layer's kind in the cache (None: stored in full) and the window its attention masks with
        # (a cache built without kinds stores a sliding layer in full and masks it all the same).
        kind, window = self.cache.layer_windows[layer], self.windows[layer]
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        threads = self.products.threads
        runs_paged = softcap is None and paged_attention_runs(q, keys)
        paged = [runs_paged and self._pageable(group, kind) for group in self.groups]
        if len(paged) == 1 and paged[0]:  # a pure decode step: write and attend in one op
            table, key_start, positions = self._paged_rows(0, kind)
            write = (k[0].transpose(0, 1), v[0].transpose(0, 1), self.write_slots[kind])  # [B, Hkv, D] x 2, [B]
            out = paged_attention(q[0].transpose(0, 1), keys, values, table, key_start, positions,
                                  self.cache.block_size, window, scale, self._bias(0, kind), write,
                                  threads=threads)  # [B, H, D]
            return out.transpose(0, 1)[None]  # [1, H, B, D]
        start = self.write_starts.get(kind)
        if start is None:
            keys.index_copy_(0, self.write_slots[kind], k[0].transpose(0, 1))  # [N, Hkv, D]
            values.index_copy_(0, self.write_slots[kind], v[0].transpose(0, 1))
        else:  # consecutive slots (a prompt chunk): a plain copy, 2.4x as fast as index_copy_ (one thread)
            keys[start : start + k.shape[2]].copy_(k[0].transpose(0, 1))  # [N, Hkv, D]
            values[start : start + v.shape[2]].copy_(v[0].transpose(0, 1))
        outputs = []
        for index, group in enumerate(self.groups):
            B, T = group.rows, group.queries
            if paged[index]:
                table, key_start, positions = self._paged_rows(index, kind)
                qg = q[0, :, group.first : group.first + B].transpose(0, 1)  # [B, H, D]
                out = paged_attention(qg, keys, values, table, key_start, positions, self.cache.block_size,
                                      window, scale, self._bias(index, kind), threads=threads)  # [B, H, D]
                outputs.append(out.transpose(0, 1))  # [H, B, D]
                continue
            qg = q[0, :, group.first : group.first + B * T].unflatten(1, (B, T)).transpose(0, 1)  # [B, H, T, D]
            mask = self._mask(index, kind, window)
            shared_blocks = group.shared_blocks if kind is None else group.window_shared.get(kind, 0)
            table = group.block_table if kind is None else group.window_tables[kind][0]
            if shared_blocks:
                out = self._attend_shared(group, table, shared_blocks, keys, values, qg, mask, scale, softcap)
            else:
                kg, vg = self._keys_values(index, kind, table, keys, values)  # [B, Hkv, S, D] each
                out = attention(qg, kg, vg, mask, scale, softcap, threads=threads)  # [B, H, T, D]
            outputs.append(out.transpose(0, 1).flatten(1, 2))  # [H, B*T, D]
        return torch.cat(outputs, dim=1)[None] if len(outputs) > 1 else outputs[0][None]  # [1, H, N, D]

    def _keys_values(self, index: int, kind: int | None, table: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's keys and values [B, Hkv, S, D] in a kind through its table [B, n]: gathered, or where
        the group is one row whose blocks are consecutive (a sequence's first prompt chunk in a new engine),
        a view of the layer's buffers, the same layout as the gather's without copying it."""
        key = ("first block", index, kind)
        if key not in self._masks:
            consecutive = table.shape[0] == 1 and bool((table[0, 1:] - table[0, :-1] == 1).all())
            self._masks[key] = int(table[0, 0]) if consecutive else None
        first = self._masks[key]
        if first is None:
            return self.cache.gather(keys, table), self.cache.gather(values, table)
        size, n = self.cache.block_size, table.shape[1]
        return tuple(buffer[first * size : (first + n) * size][None].transpose(1, 2)  # [1, S, Hkv, D] -> [1, Hkv, S, D]
                     for buffer in (keys, values))

    def decode_operands(self, layer: int) -> tuple | None:
        """When every row of the step decodes one token and the layer's attention is one paged op:
        (keys, values [slots, Hkv, D], write slots [N], table [N, n], first key position [N], query
        positions [N], window or None) of the layer, as ``attend`` would use them; else None."""
        kind = self.cache.layer_windows[layer]
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        if len(self.groups) != 1 or not self._pageable(self.groups[0], kind) or keys.dtype != torch.float32:
            return None
        table, key_start, positions = self._paged_rows(0, kind)
        return keys, values, self.write_slots[kind], table, key_start, positions, self.windows[layer]

    @staticmethod
    def _pageable(group: AttentionGroup, kind: int | None) -> bool:
        """A group the paged op serves: one query per row, no FastSeq shared prefix in this kind."""
        shared = group.shared_blocks if kind is None else group.window_shared.get(kind, 0)
        return group.queries == 1 and not shared and not group.prompt

    def _paged_rows(self, index: int, kind: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A one-query group's (table [B, n], first key position [B], query positions [B]) in a kind."""
        key = ("rows", index, kind)
        if key not in self._masks:
            group = self.groups[index]
            positions = group.query_positions[:, 0].contiguous()  # [B]
            if kind is None:
                self._masks[key] = (group.block_table, torch.zeros_like(positions), positions)
            else:
                table, key_starts = group.window_tables[kind]  # [B, m], [B, 1]
                self._masks[key] = (table, key_starts[:, 0].contiguous(), positions)
        return self._masks[key]

    def _bias(self, index: int, kind: int | None) -> torch.Tensor | None:
        """A one-query group's position bias [B, 1 or H, S] over its keys of a kind, or None."""
        if self.score_bias is None:
            return None
        key = ("bias", index, kind)
        if key not in self._masks:
            bias = self.score_bias(self._distance(index, kind))  # [B, 1|H, 1, S]
            self._masks[key] = bias[:, :, 0].float().contiguous()  # [B, 1|H, S]
        return self._masks[key]

    def _attend_shared(self, group: AttentionGroup, table: torch.Tensor, m: int, keys: torch.Tensor,
                       values: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, scale: float,
                       softcap: float | None) -> torch.Tensor:
        """A group whose runs of ``fold`` rows share the first ``m`` blocks of their tables [B, n]
        in this kind: those keys once per run."""
        shared_table = table[:: group.fold, :m]  # [B / fold, m]: the first row of each run
        own_table = table[:, m:]  # [B, n - m]
        gather = self.cache.gather
        return shared_prefix_attention(q, gather(keys, shared_table), gather(values, shared_table),
                                       gather(keys, own_table), gather(values, own_table), mask, scale, softcap)

    def _mask(self, index: int, kind: int | None, window: int | None) -> torch.Tensor:
        """Additive mask (plus position bias) [B, 1 or H, T, S] of a group over the keys of a cache
        kind, built once per (kind, window)."""
        key = (index, kind, window)
        if key not in self._masks:
            self._masks[key] = position_mask(self._distance(index, kind), window, self.score_bias, self.dtype)
        return self._masks[key]

    def _distance(self, index: int, kind: int | None) -> torch.Tensor:
        """Key minus query position [B, T, S] of a group over its table's keys in a cache kind."""
        group = self.groups[index]
        table, key_starts = (group.block_table, 0) if kind is None else group.window_tables[kind]
        key_positions = key_starts + torch.arange(table.shape[1] * self.cache.block_size,
                                                  device=group.query_positions.device)  # [S] or [B, S]
        return key_positions.view(-1, 1, key_positions.shape[-1]) - group.query_positions[:, :, None]  # [B, T, S]


def attention_group(cache: SlotCache, first: int, rows: list[tuple[list[int], int, int]], fold: int = 1,
                    shared_blocks: int = 0) -> AttentionGroup:
    """The group of ``rows`` (block table, first position, token count; every row the same count),
    whose flat tokens start at ``first``: each kind's tables and the query positions. ``fold``,
    ``shared_blocks``: runs of rows holding the same first full-kind blocks (``for_rows``); the
    sliding kinds' tables then start together, so the shared blocks still visible lead each."""
    device = cache.keys.device
    count = rows[0][2]
    tables, starts = [row[0] for row in rows], [row[1] for row in rows]
    ends = [start + count for start in starts]
    query_positions = torch.tensor(starts, device=device)[:, None]  # [B, 1]
    if count > 1:
        query_positions = query_positions + torch.arange(count, device=device)  # [B, T]
    block_table = cache.block_tables(tables, cache.pool.blocks_for(max(ends)))
    window_tables = {w: cache.window_tables(tables, starts, ends, w, common_first=shared_blocks > 0)
                     for w in cache.windows}
    size = cache.block_size
    window_shared = {w: max(0, shared_blocks - min(first_visible_block(w, start, size) for start in starts))
                     for w in window_tables}
    return AttentionGroup(first, len(rows), count, block_table, query_positions, window_tables, fold, shared_blocks,
                          window_shared)
