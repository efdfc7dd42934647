"""The KV pool's slots (genback.llm.hf.cache.kv_pool): allocation, runs, freeing, growth that keeps
every stored value, and reads as views or gathers, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genback.llm.hf.cache.kv_pool import INITIAL_SLOTS, KVPool, consecutive_heads, run_start

LAYOUT = (2, 1, 3, torch.float32, torch.device("cpu"))


def test_slot_zero_is_never_handed_out_and_reads_as_zeros():
    pool = KVPool(LAYOUT, capacity=4)
    assert torch.equal(pool.store[:, :, :, 0], torch.zeros(2, 2, 1, 3))
    slots = pool.alloc(100)
    assert 0 not in slots.tolist() and pool.capacity >= 101
    assert torch.equal(pool.store[:, :, :, 0], torch.zeros(2, 2, 1, 3))  # (kept by growth)


def test_runs_of_16_or_more_are_one_ascending_run_and_read_in_place():
    pool = KVPool(LAYOUT, capacity=64)
    small = pool.alloc(5)
    pool.free(small)
    prompt = pool.alloc(40)  # from the never-used end, not the freed 5
    assert run_start(prompt) == prompt[0] and prompt.tolist() == list(range(6, 46))
    view = pool.read(prompt)
    assert view.data_ptr() == pool.store[:, :, :, prompt[0]].data_ptr()  # a view, no copy
    again = pool.alloc(3)  # short ones reuse freed slots first
    assert set(again.tolist()) <= set(small.tolist())
    assert run_start(np.array([3, 5])) == -1 and run_start(np.array([7])) == 7


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=40))
def test_alloc_free_and_growth_keep_every_value(ops):
    """Random allocations and frees: live slots are distinct and never 0, in-use counts agree,
    and every value written to a live slot survives later growths of the store."""
    pool = KVPool(LAYOUT, capacity=8)
    live: dict[int, float] = {}
    held: list[np.ndarray] = []
    value = 1.0
    for alloc, n in ops:
        if alloc or not held:
            slots = pool.alloc(n)
            assert len(slots) == n and 0 not in slots.tolist()
            assert not set(slots.tolist()) & set(live)
            for s in slots.tolist():
                pool.store[:, :, :, s] = value
                live[s] = value
                value += 1
            held.append(slots)
        else:
            slots = held.pop(n % len(held))
            pool.free(slots)
            for s in slots.tolist():
                del live[s]
        assert pool.in_use == len(live)
    for s, v in live.items():
        assert bool((pool.store[:, :, :, s] == v).all())
    if live:
        order = np.array(sorted(live))
        got = pool.read(order)[0, 0, 0, :, 0]
        assert got.tolist() == [live[s] for s in order.tolist()]


def test_growth_counts_versions_and_clear_frees_everything():
    pool = KVPool(LAYOUT, capacity=8)
    v = pool.version
    pool.alloc(7)
    assert pool.version == v
    pool.alloc(20)
    assert pool.version == v + 1 and pool.capacity >= 28
    pool.alloc(INITIAL_SLOTS)
    assert pool.version == v + 2 and pool.capacity > INITIAL_SLOTS
    pool.clear()  # (a store grown past the initial size is released)
    assert pool.in_use == 0 and pool.alloc(3).tolist() == [1, 2, 3]
    assert pool.capacity == INITIAL_SLOTS and pool.version == v + 3


def test_write_and_gather_per_layer():
    pool = KVPool(LAYOUT, capacity=16)
    slots = pool.alloc(4)
    idx = torch.from_numpy(slots)
    key = torch.arange(12.0).reshape(1, 4, 3)
    pool.write(1, idx, key, -key)
    got = pool.gather(1, idx.flip(0))
    assert torch.equal(got[0, 0], key[0].flip(0)) and torch.equal(got[1, 0], -key[0].flip(0))
    with pytest.raises((IndexError, RuntimeError)):  # (PyTorch's error for an index past the end)
        pool.gather(1, torch.tensor([pool.capacity]))


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_keys_and_values_of_one_product_are_written_in_one_copy(heads, monkeypatch):
    """Keys and values that are consecutive head blocks of one product's columns (``[rows,
    (Hq + 2 * Hkv) * D]``, viewed ``[Hkv, rows, D]`` each, as the decode step's cache hands
    them over), or of one ``[2, Hkv, rows, D]`` tensor, are written by one ``index_copy_``
    (counted) and store what two writes store; keys and values of separate tensors, the values
    first or of another shape take one copy each, with the same result."""
    D, Hq, R = 5, 4, 6
    gen = torch.Generator().manual_seed(heads)
    layout = (2, heads, D, torch.float32, torch.device("cpu"))
    product = torch.randn(R, (Hq + 2 * heads) * D, generator=gen)
    heads_of = lambda block: product[:, block * D:(block + heads) * D].view(R, heads, D)  # noqa
    key, value = heads_of(Hq).transpose(0, 1), heads_of(Hq + heads).transpose(0, 1)
    both = consecutive_heads(key, value)
    assert both is not None and torch.equal(both, torch.cat([key, value]))
    loose = torch.randn(2, heads, R, D, generator=gen)
    assert consecutive_heads(value, key) is None  # (the values first)
    assert consecutive_heads(key, key.clone()) is None  # (another tensor)
    assert torch.equal(consecutive_heads(loose[0], loose[1]), loose.view(2 * heads, R, D))
    assert consecutive_heads(key[:, :-1], value[:, :-1]) is not None  # (fewer rows: a view)
    assert consecutive_heads(key, value[:, :, :-1]) is None  # (another shape)
    copies = []
    real = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_",
                        lambda self, *a: copies.append(1) or real(self, *a))
    for k, v, n in ((key, value, 1), (key.contiguous(), value.contiguous(), 2),
                    (value, key, 2), (loose[0], loose[1], 1),
                    (loose[0], loose[1].clone(), 2)):
        one, two = KVPool(layout, capacity=16), KVPool(layout, capacity=16)
        slots = torch.from_numpy(one.alloc(R)[::-1].copy())
        two.alloc(R)
        copies.clear()
        one.write(1, slots, k, v)
        assert len(copies) == n
        two.store[1, 0].index_copy_(1, slots, k.contiguous())
        two.store[1, 1].index_copy_(1, slots, v.contiguous())
        assert torch.equal(one.store[1][:, :, slots], two.store[1][:, :, slots])
        assert torch.equal(one.store[1][:, :, slots], torch.stack([k, v]))


@settings(max_examples=30, deadline=None)
@given(heads=st.integers(1, 4), n=st.integers(1, 300), seed=st.integers(0, 1000))
def test_gathers_and_reads_equal_indexing_of_the_store(heads, n, seed):
    """``gather`` (with and without ``out``) and a ``read`` of slots that are not one run equal
    plain indexing of the store at those slots, for any number of KV heads (the gathers select
    over a flattened view of the store)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool((3, heads, 5, torch.float32, torch.device("cpu")), capacity=512)
    slots = pool.alloc(400)
    pool.store[:, :, :, 1:401] = torch.randn(3, 2, heads, 400, 5, generator=gen)
    idx = torch.from_numpy(slots[torch.randint(0, 400, (n,), generator=gen).numpy()])
    for layer in range(3):
        want = pool.store[layer][:, :, idx]
        assert torch.equal(pool.gather(layer, idx), want)
        out = torch.empty(2, heads, n, 5)
        assert pool.gather(layer, idx, out=out) is out and torch.equal(out, want)
    picked = idx.numpy()
    if run_start(picked) < 0:
        assert torch.equal(pool.read(picked), pool.store[:, :, :, idx])
