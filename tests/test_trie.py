"""TokenCharacterTrie / ParallelTokenCharacterTrie: hand-checked toy trie, brute force on real
vocabularies (SmolLM2, GPT-2, Gemma-3), backend agreement, bad inputs."""

import bisect
import math

import numpy as np
import pytest
import torch

import _vocab_fixtures as F
from genback.tokenization import Token
from genback.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

torch.set_num_threads(1)
NEG = -np.inf

# toy vocabulary: "a", "ab", "b", "ab" (a duplicate, kept apart by id), "" ; weights 1,2,4,8,16
TOY = [Token(0, b"a"), Token(1, b"ab"), Token(2, b"b"), Token(3, b"ab"), Token(4, b"")]
TOY_W = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
# written by hand: prefix -> (sum, max) of the tokens starting with the prefix
TOY_SUM = {b"": 31.0, b"a": 11.0, b"ab": 10.0, b"b": 4.0}
TOY_MAX = {b"": 16.0, b"a": 8.0, b"ab": 8.0, b"b": 4.0}


@pytest.fixture(params=["cpu", "parallel"])
def make(request):
    if request.param == "cpu":
        return TokenCharacterTrie
    return lambda d: ParallelTokenCharacterTrie(d, device="cpu")


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def test_toy_structure():
    t = TokenCharacterTrie(TOY)
    a, ab, b = t.lookup(b"a"), t.lookup(b"ab"), t.lookup(b"b")
    assert t.root == 0 and t.num_nodes == 9  # root, a, ab, b + 5 leaves
    assert set(t.children[t.root]) == {97, 98, (None, 4)}
    assert t.children[t.root][97] == a and t.children[a][98] == ab and t.children[t.root][98] == b
    assert set(t.children[ab]) == {(None, 1), (None, 3)}  # duplicates: two leaves
    assert t.node2prefix[ab] == [97, 98] and t.node2prefix[t.children[ab][(None, 3)]] == [97, 98]
    assert t.word2leaf[(b"ab", 1)] != t.word2leaf[(b"ab", 3)]
    assert t.leaf2word[t.word2leaf[(b"", 4)]] == (b"", 4)
    assert t.lookup(b"c") is None and t.lookup(b"abc") is None and t.lookup(b"") == 0
    assert list(t.token_id_to_leaf) == [t.word2leaf[(bytes(x), x.token_id)] for x in TOY]
    # pre-order: every subtree is a contiguous id range, parents before children
    assert a < ab < t.children[ab][(None, 1)] and a < b


def test_toy_values_by_hand(make):
    t = make(TOY)
    s, m = _np(t.weight_sum(TOY_W)), _np(t.weight_max(np.log(TOY_W)))
    lse = _np(t.weight_logsumexp(np.log(TOY_W)))
    for prefix in TOY_SUM:
        n = t.lookup(prefix)
        assert s[n] == TOY_SUM[prefix] and math.isclose(m[n], math.log(TOY_MAX[prefix]))
        assert math.isclose(lse[n], math.log(TOY_SUM[prefix]))
    for i, w in enumerate(TOY_W):
        assert s[t.token_id_to_leaf[i]] == w


def test_toy_log_weights_with_minus_inf(make):
    t = make(TOY)
    lw = np.array([NEG, NEG, 0.0, NEG, NEG])  # only "b" is possible
    m, lse, s = (_np(f(lw)) for f in (t.weight_max, t.weight_logsumexp, t.weight_sum))
    for prefix, want in {b"": 0.0, b"a": NEG, b"ab": NEG, b"b": 0.0}.items():
        assert m[t.lookup(prefix)] == want and lse[t.lookup(prefix)] == want
    neg = np.array([-5.0, -3.0, -7.0, -4.0, -9.0])  # all negative: max must not start at 0
    assert _np(t.weight_max(neg))[t.lookup(b"a")] == -3.0
    assert _np(t.weight_max(neg))[0] == -3.0
    huge = np.array([-1000.0, -1001.0, -2000.0, -1002.0, NEG])  # exp underflows in float64
    got = _np(t.weight_logsumexp(huge))[t.lookup(b"a")]
    assert math.isclose(got, -1000.0 + math.log(1 + math.exp(-1) + math.exp(-2)), rel_tol=1e-12)


def test_toy_batch_matches_rows(make):
    t = make(TOY)
    W = np.stack([TOY_W, TOY_W[::-1], np.zeros(5)])
    B = _np(t.batch_weight_sum(W))
    assert B.shape == (3, t.num_nodes)
    for r in range(3):
        np.testing.assert_array_equal(B[r], _np(t.weight_sum(W[r])))


def test_non_bytes_item_is_its_own_edge():
    class EOSLike:  # like genlm-control's EndOfSequence: iterates to itself
        def __iter__(self):
            return iter([self])

        def __hash__(self):
            return 1

        def __eq__(self, other):
            return isinstance(other, EOSLike)

    eos = EOSLike()
    t = TokenCharacterTrie([Token(0, b"a"), eos])
    n = t.children[t.root][eos]
    assert t.node2prefix[n] == [eos] and t.children[n] == {(None, 1): t.token_id_to_leaf[1]}
    assert t.lookup([eos]) == n and t.lookup(b"a") != n
    assert t.word2leaf[eos] == t.token_id_to_leaf[1]
    s = t.weight_sum(np.array([0.25, 0.75]))
    assert s[0] == 1.0 and s[n] == 0.75


def test_plain_bytes_duplicates_rejected_tokens_accepted():
    with pytest.raises(ValueError, match="duplicate bytes b'x'"):
        TokenCharacterTrie([b"x", b"y", b"x"])
    with pytest.raises(ValueError, match="duplicate Token id 3"):
        TokenCharacterTrie([Token(3, b"x"), Token(3, b"y")])
    t = TokenCharacterTrie([b"x", b"xy"])
    assert t.word2leaf[b"xy"] == t.token_id_to_leaf[1]


@pytest.mark.parametrize(
    "bad, exc, msg",
    [
        (np.ones(4), ValueError, r"ws must have shape \(5,\).*got shape \(4,\)"),
        (np.ones((2, 5)), ValueError, r"ws must have shape \(5,\)"),
        (np.array([1, 2, np.nan, 4, 5.0]), ValueError, r"ws\[2\] is NaN"),
        (np.ones(5, bool), TypeError, "bool weights are ambiguous"),
        (np.ones(5, complex), TypeError, "complex"),
        (np.array(["a"] * 5), TypeError, "real floating"),
        (torch.ones(5, dtype=torch.bool), TypeError, "bool"),
    ],
)
def test_bad_single_row(make, bad, exc, msg):
    with pytest.raises(exc, match=msg):
        make(TOY).weight_sum(bad)


def test_bad_batches_and_ints(make):
    t = make(TOY)
    with pytest.raises(ValueError, match=r"W must have shape \(B, 5\).*\(2, 2, 5\)"):
        t.batch_weight_max(np.ones((2, 2, 5)))
    with pytest.raises(ValueError, match=r"W must have shape \(B, 5\)"):
        t.batch_weight_max(np.ones(5))
    with pytest.raises(ValueError, match="NaN"):
        t.batch_weight_max(np.array([TOY_W, [1, 1, 1, 1, np.nan]]))
    assert _np(t.weight_sum(np.array([1, 2, 4, 8, 16])))[0] == 31.0  # ints are cast to float64
    assert _np(t.weight_sum(torch.tensor(TOY_W, dtype=torch.float32)))[0] == 31.0


def test_visualize():
    graphviz = pytest.importorskip("graphviz")
    t = TokenCharacterTrie(TOY)
    dot = t.visualize(t.weight_sum(TOY_W))
    assert isinstance(dot, graphviz.Digraph)
    assert "31" in dot.source and "end (3)" in dot.source
    part = t.visualize(prefix=b"ab")
    assert "end (1)" in part.source and "end (0)" not in part.source
    assert t.visualize(max_nodes=2).source.count("->") == 1
    with pytest.raises(ValueError, match="not a prefix"):
        t.visualize(prefix=b"zz")
    with pytest.raises(ValueError, match="shape"):
        t.visualize(np.ones(3))


# ------------------------------------------------------------------ real vocabularies
@pytest.fixture(scope="module", params=["smollm2", "gpt2", "gemma3"])
def real(request):
    vocab = F.byte_vocab(request.param)
    if vocab is None:
        pytest.skip(F.MISSING[request.param])
    return request.param, vocab, TokenCharacterTrie(vocab)


def _brute(vocab, trie, W, nodes):
    """Sum / max / logsumexp over tokens whose bytes start with node2prefix[node] (by bisect
    over an independently sorted word list), for inner nodes; leaves: their own weight."""
    words = sorted((t.byte_string, t.token_id) for t in vocab)
    keys = [w for w, _ in words]
    ids = np.array([i for _, i in words])
    out = {}
    for n in nodes:
        if trie.leaf_mask[n]:
            sel = np.array([trie.leaf2word[n][1]])  # (bytes, token_id) of the leaf
        else:
            p = bytes(trie.node2prefix[n])
            lo = bisect.bisect_left(keys, p)
            hi = lo
            while hi < len(keys) and keys[hi].startswith(p):
                hi += 1
            sel = ids[lo:hi]
        x = W[:, sel]
        m = x.max(axis=1)
        safe = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            lse = safe + np.log(np.exp(x - safe[:, None]).sum(axis=1))
        out[n] = (x.sum(axis=1), m, lse)
    return out


def test_brute_force_real(real):
    name, vocab, trie = real
    rng = np.random.default_rng(0)
    V = len(vocab)
    probs = rng.dirichlet(np.full(V, 0.1), size=2)  # many tiny probabilities
    logw = np.log(probs)
    logw[:, rng.random(V) < 0.3] = NEG  # log weights with -inf
    depth1 = list(trie.children[trie.root].values())
    sample = rng.choice(trie.num_nodes, 300, replace=False).tolist()
    nodes = sorted(set([trie.root] + depth1 + sample))
    expected_p = _brute(vocab, trie, probs, nodes)
    expected_l = _brute(vocab, trie, logw, nodes)
    S, M, L = trie.batch_weight_sum(probs), trie.batch_weight_max(logw), trie.batch_weight_logsumexp(logw)
    for n in nodes:
        np.testing.assert_allclose(S[:, n], expected_p[n][0], rtol=1e-12, atol=0)
        np.testing.assert_array_equal(M[:, n], expected_l[n][1])
        np.testing.assert_allclose(L[:, n], expected_l[n][2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(S[:, 0], 1.0, rtol=1e-12)


def test_structure_real(real):
    name, vocab, trie = real
    words = {t.byte_string for t in vocab}
    prefixes = {w[:d] for w in words for d in range(len(w) + 1)}
    assert trie.num_nodes == len(prefixes) + len(vocab)  # inner nodes + one leaf per token
    rng = np.random.default_rng(1)
    for w in rng.choice(sorted(words), 200):
        for d in range(len(w) + 1):
            n = trie.lookup(w[:d])
            assert n is not None and bytes(trie.node2prefix[n]) == w[:d]
    assert trie.lookup(b"\xff\xfe\xfd\xfc") is None


def test_parallel_matches_cpu_real(real):
    name, vocab, trie = real
    par = ParallelTokenCharacterTrie(vocab, device="cpu")
    rng = np.random.default_rng(2)
    W = np.log(rng.dirichlet(np.full(len(vocab), 0.5), size=3))
    W[0, rng.random(len(vocab)) < 0.5] = NEG
    np.testing.assert_allclose(par.batch_weight_sum(np.exp(W), as_numpy=True), trie.batch_weight_sum(np.exp(W)), rtol=1e-12)
    np.testing.assert_array_equal(par.batch_weight_max(torch.tensor(W)).numpy(), trie.batch_weight_max(W))
    np.testing.assert_allclose(par.weight_logsumexp(W[0], as_numpy=True), trie.weight_logsumexp(W[0]), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ random small vocabularies
@pytest.mark.parametrize("seed", range(6))
def test_random_small_vocab_brute_force(seed):
    """Odd, even and power-of-two sizes, NUL bytes (zero padding in the 8-byte sort keys), long
    shared prefixes (several LCP passes), duplicates; sums, maxes with -inf and negatives."""
    rng = np.random.default_rng(seed)
    alphabet = [b"\x00", b"a", b"b", b"\xff"]
    for V in (1, 2, 3, 7, 8, 9, 16, 17, 31, 64, 65):
        words = [b"".join(rng.choice(alphabet, rng.integers(0, 24))) for _ in range(V)]
        vocab = [Token(i, w) for i, w in enumerate(words)]
        t = TokenCharacterTrie(vocab)
        assert [bytes(vocab[i]) for i in t.node_tokens(t.root)] == sorted(words)
        W = rng.standard_normal((2, V))
        W[0, rng.random(V) < 0.4] = NEG
        S, M = t.batch_weight_sum(np.exp(W)), t.batch_weight_max(W)
        for n in range(t.num_nodes):
            if t.leaf_mask[n]:
                sel = [t.leaf2word[n][1]]
            else:
                p = bytes(t.node2prefix[n])
                sel = [i for i, w in enumerate(words) if w.startswith(p)]
            np.testing.assert_allclose(S[:, n], np.exp(W[:, sel]).sum(axis=1), rtol=1e-13, atol=0)
            np.testing.assert_array_equal(M[:, n], W[:, sel].max(axis=1))


def test_plain_bytes_are_deprecated_and_duplicates_named_as_genlm_does():
    import warnings

    with pytest.warns(DeprecationWarning, match="plain bytes"):
        TokenCharacterTrie([b"a", b"ab"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Token objects: no warning
        TokenCharacterTrie([Token(0, b"a"), Token(1, b"a")])
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="Duplicate word in vocabulary"):
        TokenCharacterTrie([b"x", b"y", b"x"])
