"""The block plan on a torch device (``genback.trie.device_blocks``), as ``ParallelTokenCharacterTrie``
runs it: against the CPU trie on random vocabularies (maxima bit for bit), with every grouping of
the segments, its layout's invariants, determinism, and no scatter or accumulating index kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from genback.tokenization import Token
from genback.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from genback.trie.device_blocks import make_device_blocks, run_device_blocks

torch.set_num_threads(1)
NEG = -np.inf


def _vocab(rng, V: int) -> list[Token]:
    """``V`` random words over a small alphabet: long shared prefixes, deep chains, duplicates."""
    alphabet = [b"\x00", b"a", b"b", b"\xff"]
    return [Token(i, b"".join(rng.choice(alphabet, rng.integers(0, 12)))) for i in range(V)]


def _weights(rng, V: int) -> np.ndarray:
    """Three rows of log weights: one with ``-inf`` holes, one of large negatives, one mixed."""
    W = rng.standard_normal((3, V))
    W[0, rng.random(V) < 0.4] = NEG
    W[1] = -1e3 * rng.random(V)
    W[2, rng.random(V) < 0.1] = NEG
    return W


def _run(db, W: torch.Tensor, op: str) -> torch.Tensor:
    """Node values ``(b, N)`` of ``W`` ``(b, V)`` through ``db`` (what the trie's eager path does)."""
    E = torch.full((W.shape[0], db.num_columns), float("nan"), dtype=W.dtype)  # unwritten = NaN
    E[:, : db.num_items] = W[:, db.order]
    run_device_blocks(db, E, torch.empty((W.shape[0], db.num_terms), dtype=W.dtype), op)
    return E[:, db.node_src]


@pytest.mark.parametrize("seed", range(4))
def test_every_grouping_matches_the_cpu_trie(seed):
    """One group per block count (``kernel_cost=0``), the default, and one group for all
    (``kernel_cost=inf``): maxima bit for bit, sums and log-sum-exps to float64 rounding."""
    rng = np.random.default_rng(seed)
    for V in (1, 2, 3, 8, 17, 64, 300, 1000):
        cpu = TokenCharacterTrie(_vocab(rng, V))
        W = _weights(rng, V)
        ref_max, ref_sum = cpu.batch_weight_max(W), cpu.batch_weight_sum(np.exp(W))
        ref_lse = cpu.batch_weight_logsumexp(W)
        fin = np.isfinite(ref_lse)
        for cost in (0.0, 4096.0, float("inf")):
            db = make_device_blocks(cpu._blocks, cpu._layout.start, torch.device("cpu"), kernel_cost=cost)
            if cost == float("inf"):
                assert len(db.groups) <= 1
            np.testing.assert_array_equal(_run(db, torch.tensor(W), "max").numpy(), ref_max)
            np.testing.assert_allclose(_run(db, torch.tensor(np.exp(W)), "sum").numpy(), ref_sum, rtol=1e-13, atol=0)
            lse = _run(db, torch.tensor(W), "logsumexp").numpy()
            assert (np.isfinite(lse) == fin).all() and (lse[~fin] == ref_lse[~fin]).all()
            np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-13, atol=1e-13)


def test_layout_invariants():
    """Groups tile the gather buffer and the segment columns in order, are padded only with the
    identity column, and read only leaf, tree and identity columns (so one gather feeds them all);
    every node reads a leaf, tree or segment column; tree levels halve down to one block."""
    rng = np.random.default_rng(7)
    V = 1000
    par = ParallelTokenCharacterTrie(_vocab(rng, V), device="cpu")
    db, bp = par._blocks_dev, par._blocks
    assert db.pad == bp.tree_size and db.num_items == V
    assert [m for _, m, _ in db.levels] == [V >> j for j in range(1, len(db.levels) + 1)]
    x, e = 0, db.pad + 1
    for x_lo, n, K, e_lo in db.groups:
        assert (x_lo, e_lo) == (x, e) and K >= 2 and n >= 1
        M = db.terms[x_lo : x_lo + n * K].view(n, K).numpy()
        assert (M[:, :2] != db.pad).all()  # a segment has at least two blocks
        assert (M <= db.pad).all()
        x, e = x + n * K, e + n
    assert (x, e) == (db.num_terms, db.num_columns)
    src = db.node_src.numpy()
    assert src.min() >= 0 and src.max() < db.num_columns and not (src == db.pad).any()
    single = par._layout.end - par._layout.start == 1
    np.testing.assert_array_equal(src[single], par._layout.start[single])  # one word: its leaf column


def test_reductions_are_deterministic_and_scatter_free():
    """Two calls give bit-identical results, and no reduction launches a scatter, ``index_add``,
    ``index_put`` or ``segment_reduce`` kernel (on CUDA those accumulate with atomics, in no fixed
    order): only gathers, elementwise and dense reductions."""
    rng = np.random.default_rng(3)
    V = 2000
    par = ParallelTokenCharacterTrie(_vocab(rng, V), device="cpu")
    W = torch.tensor(_weights(rng, V))
    P = torch.exp(W)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = (par.batch_weight_sum(P), par.batch_weight_max(W), par.batch_weight_logsumexp(W))
    names = {ev.key for ev in prof.key_averages()}
    banned = ("scatter", "index_add", "index_put", "index_reduce", "segment_reduce", "index_copy", "put_")
    assert not [n for n in names if any(b in n for b in banned)], sorted(names)
    assert "aten::index_select" in names
    second = (par.batch_weight_sum(P), par.batch_weight_max(W), par.batch_weight_logsumexp(W))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_float32_rows_and_float32_trie():
    """Rows of another float dtype are cast in the leaf gather (no host round trip); a float32 trie
    gives the float64 trie's maxima of float32 weights exactly."""
    rng = np.random.default_rng(5)
    V = 500
    vocab = _vocab(rng, V)
    W = torch.tensor(_weights(rng, V))
    f64 = ParallelTokenCharacterTrie(vocab, device="cpu")
    f32 = ParallelTokenCharacterTrie(vocab, device="cpu", dtype=torch.float32)
    assert torch.equal(f64.batch_weight_max(W.float()), f64.batch_weight_max(W.float().double()))
    got = f32.batch_weight_max(W)
    assert got.dtype == torch.float32
    assert torch.equal(got, f64.batch_weight_max(W.float()).float())
    torch.testing.assert_close(f32.batch_weight_sum(W.exp()), f64.batch_weight_sum(W.exp()).float(),
                               rtol=1e-5, atol=0)
