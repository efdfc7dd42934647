"""The engine facade (genback.engine) on the real SmolLM2: contract, exactness, generation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest
import torch

from genback.engine import (GenbackEngine, GenerationRequest, LoglikelihoodRequest,
                            RollingLoglikelihoodRequest, SessionClosed)
from genback.engine.encoding import encode_pair
from genback.queries.window import rolling_windows
from genback.llm import AsyncTransformer


@pytest.fixture(scope="module")
def lm(module_smol_lm):
    return module_smol_lm


@pytest.fixture(scope="module")
def session(lm):
    s = GenbackEngine(lm=lm).build()
    yield s
    s.close()


def brute_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Uncached fp32 forward: log-prob rows ``[len(ids), V]`` (row i predicts token i + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


def brute_score(model, ctx, cont):
    rows = brute_logprobs(model, ctx + cont)[len(ctx) - 1: len(ctx) + len(cont) - 1]
    lps = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
    return float(lps.double().sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())


PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("The capital of France is ", "Paris"),  # trailing space moves to the continuation
    ("", "Hello world"),  # empty context: scored from the prefix token
    ("Question: 2+2=?\nAnswer:", " 4"),
    ("Once upon a time", ", there was a king who lived in a castle."),
    ("def f(x):\n    ", "return x + 1"),
    ("Température", " élevée"),
    ("日本の首都は", "東京です"),
]


# -- types and contract ------------------------------------------------------------------------


def test_dataclasses_match_evalution():
    ev = pytest.importorskip("evalution.engines.base")
    from genback.engine import types

    for name in ("GenerationRequest", "GenerationOutput", "LoglikelihoodRequest",
                 "LoglikelihoodOutput", "RollingLoglikelihoodRequest", "RollingLoglikelihoodOutput"):
        ours, theirs = getattr(types, name), getattr(ev, name)

        def shape(cls):
            out = []
            for f in dataclasses.fields(cls):
                default = f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
                out.append((f.name, default))
            return out

        assert shape(ours) == shape(theirs), name


def test_loglikelihood_equals_brute_force(session, smol_hf):
    model, tok = smol_hf
    outs = session.loglikelihood([LoglikelihoodRequest(c, x) for c, x in PAIRS])
    assert len(outs) == len(PAIRS)
    for (c, x), out in zip(PAIRS, outs):
        ctx, cont = encode_pair(tok, c, x)
        logprob, greedy = brute_score(model, ctx, cont)
        assert out.logprob == pytest.approx(logprob, abs=1e-4), (c, x)
        assert out.is_greedy == greedy, (c, x)
        assert out.token_count == len(cont)
    # the empty context is scored after BOS (SmolLM2 has one), the continuation without it
    assert encode_pair(tok, "", "Hello world")[0] == [tok.bos_token_id]


def test_outputs_in_request_order(session):
    reqs = [LoglikelihoodRequest(c, x, metadata={"i": i}) for i, (c, x) in enumerate(PAIRS)]
    together = session.loglikelihood(reqs[::-1], batch_size=3)
    alone = [session.loglikelihood([r])[0] for r in reqs[::-1]]
    assert [o.metadata["i"] for o in together] == list(range(len(PAIRS)))[::-1]
    for a, b in zip(together, alone):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.is_greedy == b.is_greedy


def test_pretokenized_requests_are_used_as_given(session, smol_hf):
    model, tok = smol_hf
    ctx, cont = tok.encode("The capital of France is"), tok.encode(" Paris, of course")
    out = session.loglikelihood([LoglikelihoodRequest(context_input_ids=ctx,
                                                      continuation_input_ids=cont)])[0]
    assert out.logprob == pytest.approx(brute_score(model, ctx, cont)[0], abs=1e-4)
    assert out.token_count == len(cont)


def test_choices_share_the_context_kv(smol_hf):
    model, tok = smol_hf
    lm = AsyncTransformer(model, tok)  # fresh caches to count forwarded tokens
    context = ("In the old library above the post office, a librarian named Ada kept a ledger of "
               "every book that left the building. She had worked there for")
    choices = [" thirty years", " a long time", " the council and the town", " nothing"]
    with GenbackEngine(lm=lm).build() as s:
        outs = s.loglikelihood([LoglikelihoodRequest(context, c) for c in choices])
        info = lm.cache_info()
    pairs = [encode_pair(tok, context, c) for c in choices]
    n_ctx = len(pairs[0][0])
    assert all(p[0] == pairs[0][0] for p in pairs)
    # the context is forwarded once; each choice forwards its own tokens (plus one re-read token)
    assert info["tokens_forwarded"] <= n_ctx + sum(len(cont) + 1 for _, cont in pairs)
    assert info["tokens_forwarded"] < 2 * n_ctx  # four separate forwards would be > 4 * n_ctx
    for (ctx, cont), out in zip(pairs, outs):
        assert out.logprob == pytest.approx(brute_score(model, ctx, cont)[0], abs=1e-4)
    lm.close()


def test_rolling_equals_brute_force_windows(smol_hf):
    model, tok = smol_hf
    text = "The quick brown fox jumps over the lazy dog. " * 5
    ids = tok.encode(text)
    lm = AsyncTransformer(model, tok)
    with GenbackEngine(lm=lm, max_length=16).build() as s:
        out = s.loglikelihood_rolling([RollingLoglikelihoodRequest(text)])[0]
    lm.close()
    windows = list(rolling_windows(ids, tok.bos_token_id, 16))
    assert len(windows) > 2 and sum(len(t) for _, t in windows) == len(ids)
    assert all(len(c) + len(t) - 1 <= 16 for c, t in windows)
    # brute force: each window scored on its own, uncached
    total = sum(brute_score(model, c, t)[0] for c, t in windows)
    assert out.token_count == len(ids)
    assert out.logprob == pytest.approx(total, abs=1e-4)
    # and the first window is the plain prefix-conditioned log-likelihood of the first 16 tokens
    assert windows[0] == ([tok.bos_token_id], ids[:16])


def test_empty_context_close_twice_gc_between_runs(lm):
    s = GenbackEngine(lm=lm).build()
    first = s.loglikelihood([LoglikelihoodRequest("", " Paris is a city")])[0]
    s.gc()
    assert lm.cache_info()["kv_bytes"] == 0 and lm.cache_info()["rows_cached"] == 0
    again = s.loglikelihood([LoglikelihoodRequest("", " Paris is a city")])[0]
    assert again.logprob == pytest.approx(first.logprob, abs=1e-5)
    described = s.describe_execution()
    assert described == s.describe_execution()
    json.dumps(described)
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(SessionClosed):
        s.loglikelihood([LoglikelihoodRequest("a", " b")])
    # the model was lent to the session, so it still serves
    assert lm.next_token_logprobs_sync([1, 2, 3]).shape == (lm.vocab_size,)


async def test_sync_methods_work_inside_a_running_loop(session, smol_hf):
    model, tok = smol_hf
    out = session.loglikelihood([LoglikelihoodRequest("The capital of France is", " Paris")])[0]
    ctx, cont = encode_pair(tok, "The capital of France is", " Paris")
    assert out.logprob == pytest.approx(brute_score(model, ctx, cont)[0], abs=1e-4)
    text = session.generate([GenerationRequest(prompt="Hello", max_new_tokens=2)])[0].text
    assert isinstance(text, str)


# -- bad input --------------------------------------------------------------------------------------


def test_bad_requests_get_errors_others_are_answered(session):
    good = LoglikelihoodRequest("The capital of France is", " Paris")
    outs = session.loglikelihood([good, LoglikelihoodRequest("a", "b"),  # "ab" is one token
                                  LoglikelihoodRequest("x", ""), good])
    assert outs[0].logprob == outs[3].logprob > -math.inf
    for bad in outs[1:3]:
        assert bad.logprob == -math.inf and bad.token_count == 0 and not bad.is_greedy
        assert "tokenizes to no tokens" in bad.metadata["error"]
    gens = session.generate([GenerationRequest(max_new_tokens=3),
                             GenerationRequest(prompt="Hi", max_new_tokens=-1),
                             GenerationRequest(prompt="Hi", num_beams=4),
                             GenerationRequest(prompt="Hi", max_new_tokens=2)])
    assert "needs prompt, messages" in gens[0].metadata["error"]
    assert "max_new_tokens must be an int >= 0, got -1" in gens[1].metadata["error"]
    assert "num_beams must be 1" in gens[2].metadata["error"]
    assert all(g.metadata["finish_reason"] == "error" and g.text == "" for g in gens[:3])
    assert gens[3].metadata["completion_tokens"] == 2
    with pytest.raises(ValueError, match="batch_size"):
        session.loglikelihood([good], batch_size=0)


def test_malformed_requests_name_the_field(session):
    """A stress probe's malformed requests: each fails alone with an error naming the field."""
    good = LoglikelihoodRequest("The capital of France is", " Paris")
    outs = session.loglikelihood([LoglikelihoodRequest(5, " x"), "The capital", good,
                                  LoglikelihoodRequest("a", " b", context_input_ids="abc"),
                                  LoglikelihoodRequest("a", " b", continuation_input_ids=[1.5])])
    assert outs[0].metadata["error"] == "TypeError: context must be a str or None, got int: 5"
    assert outs[1].metadata["error"].startswith(
        "TypeError: a request must be a LoglikelihoodRequest")
    assert "got str: 'The capital'" in outs[1].metadata["error"]
    assert outs[2].logprob > -math.inf and "error" not in outs[2].metadata
    assert "context_input_ids must be a list of int token ids, got str" in outs[3].metadata["error"]
    assert "continuation_input_ids[0] must be an int token id, got float: 1.5" in \
        outs[4].metadata["error"]
    gens = session.generate([GenerationRequest(prompt=5, max_new_tokens=2),
                             GenerationRequest(prompt=b"hi", max_new_tokens=2),
                             GenerationRequest(prompt=["hi"], max_new_tokens=2),
                             GenerationRequest(prompt="Hi", stop=5, max_new_tokens=2),
                             GenerationRequest(prompt="Hi", messages="hello", max_new_tokens=2),
                             GenerationRequest(prompt="Hi", max_new_tokens="2"),
                             GenerationRequest(prompt="Hi", max_new_tokens=2)])
    assert gens[0].metadata["error"] == "TypeError: prompt must be a str or None, got int: 5"
    assert "prompt must be a str or None, got bytes: b'hi'" in gens[1].metadata["error"]
    assert "prompt must be a str or None, got list: ['hi']" in gens[2].metadata["error"]
    assert "stop must be a str or a list of str, got int: 5" in gens[3].metadata["error"]
    assert "messages must be a list of dicts" in gens[4].metadata["error"]
    assert "max_new_tokens must be an int >= 0, got str: '2'" in gens[5].metadata["error"]
    assert gens[6].metadata["completion_tokens"] == 2
    rolled = session.loglikelihood_rolling([RollingLoglikelihoodRequest(7),
                                            RollingLoglikelihoodRequest("Hello there")])
    assert rolled[0].metadata["error"] == "TypeError: text must be a str or None, got int: 7"
    assert rolled[1].token_count > 0


def test_errors_raise_mode(lm):
    with GenbackEngine(lm=lm, errors="raise").build() as s:
        with pytest.raises(ValueError, match="tokenizes to no tokens"):
            s.loglikelihood([LoglikelihoodRequest("The sky is", " blue"),
                             LoglikelihoodRequest("x", "")])
        assert s.loglikelihood([LoglikelihoodRequest("The sky is", " blue")])[0].token_count == 1
    with pytest.raises(ValueError, match="backend"):
        GenbackEngine(backend="tpu")


# -- generation --------------------------------------------------------------------------------------


def brute_greedy(model, ids, n, eos):
    out = []
    for _ in range(n):
        token = int(brute_logprobs(model, ids + out)[-1].argmax())
        if token in eos:
            break
        out.append(token)
    return out


def test_greedy_generation_equals_brute_force_and_stop_strings(session, smol_hf):
    model, tok = smol_hf
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    expected = brute_greedy(model, ids, 12, {tok.eos_token_id})
    full = tok.decode(expected)
    out, cut, early = session.generate([
        GenerationRequest(prompt=prompt, max_new_tokens=12),
        GenerationRequest(prompt=prompt, max_new_tokens=12, stop=["\n"]),
        GenerationRequest(prompt=prompt, max_new_tokens=12, stop=[".", " Paris"]),
    ])
    assert out.metadata["token_ids"] == expected and out.text == full
    assert out.metadata["finish_reason"] == "length"
    assert out.metadata["prompt_tokens"] == len(ids) and out.metadata["completion_tokens"] == 12
    assert "\n" in full
    assert cut.text == full[: full.index("\n")] and cut.metadata["finish_reason"] == "stop"
    # " Paris" starts before "." in the text: the earliest stop string wins
    assert full.startswith(" Paris")
    assert early.text == "" and early.metadata["stop"] == " Paris"


def test_chat_messages_and_eos(session, smol_hf):
    model, tok = smol_hf
    messages = [{"role": "user", "content": "Say OK."}]
    out = session.generate([GenerationRequest(messages=messages, max_new_tokens=40)])[0]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    ids = tok.encode(rendered, add_special_tokens=False)
    expected = brute_greedy(model, ids, 40, {tok.eos_token_id})
    assert len(expected) < 40  # the instruct model ends its answer with <|im_end|>
    assert out.metadata["finish_reason"] == "eos"
    assert out.metadata["token_ids"] == expected


def test_seeded_sampling_is_reproducible(session):
    def req(seed, **meta):
        return GenerationRequest(prompt="Once upon a time", max_new_tokens=10, do_sample=True,
                                 temperature=1.0, metadata={"seed": seed, **meta})

    a, b, c, busy = session.generate([req(1), req(1), req(2), req(1)] +
                                     [GenerationRequest(prompt="x", max_new_tokens=5)] * 3)[:4]
    assert a.metadata["token_ids"] == b.metadata["token_ids"] == busy.metadata["token_ids"]
    assert a.metadata["token_ids"] != c.metadata["token_ids"]
    greedy = session.generate([GenerationRequest(prompt="Once upon a time", max_new_tokens=10)])[0]
    top1, nucleus = session.generate([req(5, top_k=1), req(7, top_p=1e-6)])
    assert top1.metadata["token_ids"] == greedy.metadata["token_ids"]
    assert nucleus.metadata["token_ids"] == greedy.metadata["token_ids"]


def test_generate_continuous_yields_in_completion_order(session):
    lengths = {"long": 16, "short": 1, "mid": 6}
    fed = []

    def requests():  # a lazy source: requests join while others run
        for rid, n in lengths.items():
            fed.append(rid)
            yield rid, GenerationRequest(prompt="Count: 1, 2, 3,", max_new_tokens=n)

    order = []
    for rid, out in session.generate_continuous(requests(), batch_size=3):
        order.append(rid)
        assert out.metadata["completion_tokens"] <= lengths[rid]
    assert order == ["short", "mid", "long"]
    assert sorted(fed) == sorted(lengths)
    # at most batch_size in flight: a second request is only taken after the first finishes
    got = list(session.generate_continuous(
        [(i, GenerationRequest(prompt="a", max_new_tokens=2)) for i in range(4)], batch_size=1))
    assert [rid for rid, _ in got] == [0, 1, 2, 3]


async def test_stream_and_cancel(session, lm):
    request = GenerationRequest(prompt="Once upon a time", max_new_tokens=12, stop=["\n\n"])
    events = [e async for e in session.stream(request)]
    final = events[-1].output
    assert final is not None and all(e.output is None for e in events[:-1])
    assert "".join(e.text for e in events) == final.text
    assert sum((e.token_ids for e in events), []) == final.metadata["token_ids"]
    # leaving the loop early cancels the generation: once the session's loop has no task left
    # (the cancelled generation ended), it asked a handful of steps of the 200, and no more
    long = GenerationRequest(prompt="In a galaxy far away", max_new_tokens=200)
    start = lm.cache_info()["queries"]
    seen = 0
    async for _ in session.stream(long):
        seen += 1
        if seen == 2:
            break
    await session_idle(session)
    used = lm.cache_info()["queries"] - start
    assert 2 <= used <= 20
    await session_idle(session)
    assert lm.cache_info()["queries"] - start == used


async def session_idle(session, polls: int = 1000) -> None:
    """Wait (polling, bounded) until the session's loop runs no task besides this probe."""
    async def others():
        return len(asyncio.all_tasks()) - 1

    for _ in range(polls):
        if not await asyncio.wrap_future(session._loop_thread.submit(others())):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the session's loop still runs tasks")


def test_mock_backend_matches_its_rows():
    with GenbackEngine(backend="mock").build("smollm2-135m") as s:
        tok, lm = s.tokenizer, s.lm
        out = s.loglikelihood([LoglikelihoodRequest("Hello there", " my friend")])[0]
        ctx, cont = encode_pair(tok, "Hello there", " my friend")
        rows = [lm.next_token_logprobs_sync(ctx + cont[:i]) for i in range(len(cont))]
        assert out.logprob == pytest.approx(sum(float(r[t]) for r, t in zip(rows, cont)), abs=1e-4)
        assert out.is_greedy == all(int(r.argmax()) == t for r, t in zip(rows, cont))
        gen = s.generate([GenerationRequest(prompt="Hi", max_new_tokens=5)])[0]
        assert gen.metadata["completion_tokens"] + (gen.metadata["finish_reason"] == "eos") >= 1
    with pytest.raises(RuntimeError, match="closed"):  # the session loaded the model: closed it
        lm.next_token_logprobs_sync([1, 2])


def test_engine_reads_eos_and_cache_from_the_public_surface(lm, session, gpt2_tok):
    from genback.llm import MockAsyncLM

    assert lm.tokenizer.eos_token_id in lm.eos_token_ids  # <|im_end|> = 2 on SmolLM2
    assert session.describe_execution()["kv_cache"] == lm.cache_kind == "prefix tree"
    assert session.describe_execution()["batching"] == lm.batching_kind
    assert "genback auto-batcher" in lm.batching_kind
    mock = MockAsyncLM(gpt2_tok)
    with GenbackEngine(lm=mock).build() as s:
        assert s.describe_execution()["kv_cache"] is None
        assert mock.eos_token_ids == {gpt2_tok.eos_token_id}
    mock.close()
