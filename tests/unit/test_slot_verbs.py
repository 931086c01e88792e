"""The slot cache's per-sequence verbs (seq_cp / seq_rm / seq_keep / seq_add, copy-on-write), each
checked against an explicit model of what a sequence holds: a dense list of its tokens' K/V."""

from __future__ import annotations

import random

import pytest
import torch

from fastdecode.engine.fastseq import shared_prefix_attention
from fastdecode.engine.slots import SlotCache
from fastdecode.layers.attention import attention
from fastdecode.layers.positions import RotaryEmbedding, rope_inverse_frequencies

L, HKV, D, BLOCK = 2, 2, 8, 4


def _cache(num_blocks: int = 32) -> SlotCache:
    return SlotCache(L, num_blocks, HKV, D, torch.float32, torch.device("cpu"), BLOCK)


def _write(cache: SlotCache, table: list[int], start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys, values [L, N, Hkv, D] at positions start.. of a sequence (making them writable first)."""
    end = start + keys.shape[1]
    cache.writable(table, start, end)
    slots = torch.tensor(cache.slot_ids(table, start, end))
    for layer in range(L):
        cache.layer_keys[layer].index_copy_(0, slots, keys[layer])
        cache.layer_values[layer].index_copy_(0, slots, values[layer])


def _read(cache: SlotCache, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sequence holds at positions 0..length-1 -> keys, values [L, length, Hkv, D]."""
    slots = torch.tensor(cache.slot_ids(table, 0, length))
    return cache.keys[:, slots], cache.values[:, slots]


def _random_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, HKV, D, generator=generator), torch.randn(L, n, HKV, D, generator=generator)


def test_forked_beams_share_blocks_and_copy_only_the_block_they_write():
    cache = _cache()
    prompt = cache.pool.take(3)  # 10 tokens: blocks 0, 1 full, block 2 partial
    k, v = _random_kv(10, 0)
    _write(cache, prompt, 0, k, v)
    beams = [cache.seq_cp(prompt) for _ in range(3)]
    cache.pool.release(prompt)
    assert all(beam == beams[0] for beam in beams) and cache.pool.num_free == 32 - 3
    new_k, new_v = _random_kv(3, 1)
    for index, beam in enumerate(beams):  # each beam writes its own token 10
        _write(cache, beam, 10, new_k[:, index : index + 1], new_v[:, index : index + 1])
    assert beams[0][:2] == beams[1][:2] == beams[2][:2]  # the full prompt blocks stay shared
    assert len({beam[2] for beam in beams}) == 3  # the partial block: two copies, the last writer keeps it
    assert cache.pool.num_free == 32 - 5
    for index, beam in enumerate(beams):
        keys, values = _read(cache, beam, 11)
        torch.testing.assert_close(keys, torch.cat((k, new_k[:, index : index + 1]), 1), rtol=0, atol=0)
        torch.testing.assert_close(values, torch.cat((v, new_v[:, index : index + 1]), 1), rtol=0, atol=0)


def test_seq_keep_reorders_by_reference_and_equals_explicit_copies():
    """Random beam steps (write one token per beam, then a reorder): every beam holds exactly what an
    explicit per-beam copy holds, and no block leaks once the sequences are released."""
    rng = random.Random(0)
    cache = _cache(64)
    K, prompt_length = 4, 6
    prompt = cache.pool.take(2)
    k, v = _random_kv(prompt_length, 2)
    _write(cache, prompt, 0, k, v)
    tables = [cache.seq_cp(prompt) for _ in range(K)]
    cache.pool.release(prompt)
    reference = [(k, v)] * K
    for step in range(9):
        new_k, new_v = _random_kv(K, 10 + step)
        position = prompt_length + step
        for beam in range(K):
            _write(cache, tables[beam], position, new_k[:, beam : beam + 1], new_v[:, beam : beam + 1])
            rk, rv = reference[beam]
            reference[beam] = (torch.cat((rk, new_k[:, beam : beam + 1]), 1), torch.cat((rv, new_v[:, beam : beam + 1]), 1))
        sources = [rng.randrange(K) for _ in range(K)]
        before = cache.keys.clone()
        tables = cache.seq_keep(tables, sources)
        assert torch.equal(cache.keys, before)  # a reorder moves no K/V
        reference = [reference[s] for s in sources]
        for beam in range(K):
            keys, values = _read(cache, tables[beam], position + 1)
            torch.testing.assert_close(keys, reference[beam][0], rtol=0, atol=0)
            torch.testing.assert_close(values, reference[beam][1], rtol=0, atol=0)
    cache.seq_keep(tables, [])  # every beam dropped
    assert cache.pool.num_free == 64 and set(cache.pool.ref_counts) == {0}


def test_seq_rm_releases_the_blocks_past_the_cut():
    cache = _cache()
    table = cache.pool.take(4)
    shared = cache.seq_cp(table)
    table = cache.seq_rm(table, 5)  # tokens 0..4 stay: blocks 0 and 1
    assert len(table) == 2 and cache.pool.num_free == 32 - 4  # the fork still holds the other two
    cache.seq_rm(shared, 0)
    assert cache.pool.num_free == 32 - 2


def _rope() -> RotaryEmbedding:
    inv_freq, _ = rope_inverse_frequencies(D, 10000.0, None, 512)
    return RotaryEmbedding(D, inv_freq)


def test_seq_add_moves_tokens_and_re_rotates_keys_to_their_new_positions():
    """Context shift = seq_add(-n_discard) of what follows the discarded range, then seq_rm of the
    tail: the kept keys equal keys rotated at their new positions from the start."""
    rope, cache = _rope(), _cache()
    n, n_keep, n_discard = 13, 2, 3
    raw_k, v = _random_kv(n, 3)  # keys before rotation [L, N, Hkv, D]

    def rotated(keys, positions):  # keys [L, N, Hkv, D] rotated at positions [N]
        per_layer = [rope.rotate_by(keys[layer].transpose(0, 1)[None], torch.tensor(positions))  # [1, Hkv, N, D]
                     for layer in range(L)]
        return torch.stack([x[0].transpose(0, 1) for x in per_layer])  # [L, N, Hkv, D]

    table = cache.pool.take(4)
    _write(cache, table, 0, rotated(raw_k, list(range(n))), v)
    shared = cache.seq_cp(table)  # another sequence holding the same blocks must not see the shift
    table = cache.seq_add(table, n_keep + n_discard, n, -n_discard,
                          lambda layer, keys, delta: rope.rotate_by(keys, delta))
    table = cache.seq_rm(table, n - n_discard)
    kept = list(range(n_keep)) + list(range(n_keep + n_discard, n))
    keys, values = _read(cache, table, n - n_discard)
    torch.testing.assert_close(keys, rotated(raw_k[:, kept], list(range(n - n_discard))), atol=1e-5, rtol=0)
    torch.testing.assert_close(values, v[:, kept], rtol=0, atol=0)
    keys, values = _read(cache, shared, n)
    torch.testing.assert_close(keys, rotated(raw_k, list(range(n))), rtol=0, atol=0)  # copied on write
    torch.testing.assert_close(values, v, rtol=0, atol=0)


def test_seq_add_without_rotation_only_moves_and_refuses_negative_positions():
    cache = _cache()
    table = cache.pool.take(2)
    k, v = _random_kv(6, 4)
    _write(cache, table, 0, k, v)
    table = cache.seq_add(table, 1, 6, 2)  # positions 1..5 -> 3..7 (the table grows)
    keys, _ = _read(cache, table, 8)
    torch.testing.assert_close(keys[:, 3:], k[:, 1:], rtol=0, atol=0)
    try:
        cache.seq_add(table, 1, 3, -2)
    except ValueError as error:
        assert "position -1" in str(error)
    else:
        raise AssertionError("a move below position 0 was accepted")


@pytest.mark.parametrize("heads, kv_heads, per_head_bias", [(4, 4, False), (4, 2, False), (4, 1, False), (4, 4, True)])
def test_shared_prefix_attention_equals_attention_over_each_rows_keys(heads, kv_heads, per_head_bias):
    """Beams folded into the query axis against their sample's shared keys == plain attention of
    each row over (shared keys + its own keys), under the same mask."""
    generator = torch.Generator().manual_seed(5)
    B, K, S_shared, S_own, T = 3, 4, 8, 5, 1
    q = torch.randn(B * K, heads, T, D, generator=generator)
    k_shared, v_shared = (torch.randn(B, kv_heads, S_shared, D, generator=generator) for _ in range(2))
    k_own, v_own = (torch.randn(B * K, kv_heads, S_own, D, generator=generator) for _ in range(2))
    mask = torch.zeros(B * K, heads if per_head_bias else 1, T, S_shared + S_own)
    mask[:, :, :, S_shared + 3 :] = float("-inf")  # past each row's end
    mask[1, :, :, :2] = float("-inf")  # a sliding window hides a row's oldest shared keys
    if per_head_bias:
        mask = mask + torch.randn(mask.shape, generator=generator)
    ours = shared_prefix_attention(q, k_shared, v_shared, k_own, v_own, mask, 0.3)
    full_k = torch.cat((k_shared.repeat_interleave(K, 0), k_own), 2)  # [B*K, Hkv, S, D]
    full_v = torch.cat((v_shared.repeat_interleave(K, 0), v_own), 2)
    expected = attention(q, full_k, full_v, mask, 0.3, threads=torch.get_num_threads())
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
