"""The engine facade against and inside the harnesses: lm-eval's HFLM, simple_evaluate and CLI,
Evalution, and the ``genback eval`` command (all on the real SmolLM2)."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from genback.engine import GenbackEngine, LoglikelihoodRequest, RollingLoglikelihoodRequest

DATA = Path(__file__).parent / "data" / "engine"


@pytest.fixture(scope="module")
def lm(module_smol_lm):
    return module_smol_lm


@pytest.fixture(scope="module")
def hflm(smol_hf):
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    from lm_eval.models.huggingface import HFLM

    model, tok = smol_hf
    return HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")


def _pairs(n: int) -> list[tuple[str, str]]:
    words = (DATA / "passage.txt").read_text().split()
    rng = random.Random(3)
    pairs = [("", "The harbour town"), ("The capital of France is ", "Paris"),
             ("Question: what do bees make?\nAnswer:", " Honey"), ("Température", " élevée"),
             ("def f(x):\n    ", "return x")]
    while len(pairs) < n:
        start = rng.randrange(0, len(words) - 80)
        k, m = rng.randrange(1, 60), rng.randrange(1, 8)
        pairs.append((" ".join(words[start:start + k]),
                      " " + " ".join(words[start + k:start + k + m])))
    return pairs


def _instances(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def test_loglikelihood_equals_lm_eval_hflm(lm, hflm):
    pairs = _pairs(24)
    ref = hflm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    with GenbackEngine(lm=lm).build() as s:
        outs = s.loglikelihood([LoglikelihoodRequest(c, x) for c, x in pairs])
    assert len(outs) == len(pairs) >= 20
    for pair, (logprob, greedy), out in zip(pairs, ref, outs):
        assert out.logprob == pytest.approx(logprob, abs=1e-4), pair
        assert out.is_greedy == greedy, pair
    assert any(greedy for _, greedy in ref) and not all(greedy for _, greedy in ref)


@pytest.mark.parametrize("max_length", [None, 48])
def test_rolling_equals_lm_eval_hflm(lm, hflm, max_length):
    texts = [(DATA / "passage.txt").read_text()[:1200], "Short text.",
             "She sells sea shells by the sea shore. " * 6]
    saved = hflm._max_length
    hflm._max_length = max_length  # HFLM's own override of the model window
    try:
        ref = hflm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]),
                                         disable_tqdm=True)
        window = hflm.max_length
    finally:
        hflm._max_length = saved
    with GenbackEngine(lm=lm, max_length=window).build() as s:
        outs = s.loglikelihood_rolling([RollingLoglikelihoodRequest(t) for t in texts])
    for text, r, out in zip(texts, ref, outs):
        assert out.logprob == pytest.approx(r, abs=1e-4), (max_length, text[:30])
        assert out.token_count == len(lm.tokenizer.encode(text))


def _task_dir(tmp_path) -> Path:
    (tmp_path / "genback_mc.yaml").write_text(
        "task: genback_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA / 'mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tmp_path


def _expected_mc(lm):
    rows = [json.loads(line) for line in (DATA / "mc.jsonl").read_text().splitlines()]
    with GenbackEngine(lm=lm).build() as s:
        scores = [[o.logprob for o in s.loglikelihood(
            [LoglikelihoodRequest(r["context"], c) for c in r["choices"]])] for r in rows]
    acc = sum(max(range(len(sc)), key=sc.__getitem__) == r["answer"]
              for sc, r in zip(scores, rows)) / len(rows)
    return rows, scores, acc


def test_lm_eval_simple_evaluate_local_task(lm, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from genback.engine import GenbackLM, register_lm_eval

    assert register_lm_eval() is GenbackLM and get_model("genback") is GenbackLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models stay registered
    model = GenbackLM(lm=lm, batch_size=1)  # lm-eval's default batch size is not a throttle
    assert model.session.max_in_flight == 256
    lm.clear_cache()
    before = lm.cache_info()
    results = lm_eval.simple_evaluate(model=model, tasks=["genback_mc"], log_samples=True,
                                      batch_size=1,
                                      task_manager=TaskManager(include_path=str(_task_dir(tmp_path))))
    after = lm.cache_info()
    # 8 questions x 4 choices: all in flight together, in far fewer batches than requests
    assert after["queries"] - before["queries"] == 32
    assert after["batches"] - before["batches"] <= 4
    rows, scores, acc = _expected_mc(lm)
    assert results["results"]["genback_mc"]["acc,none"] == pytest.approx(acc)
    samples = sorted(results["samples"]["genback_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(rows)
    for sample, expected in zip(samples, scores):
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-4)
    # generate_until and loglikelihood_rolling through the adapter equal the session's answers
    from genback.engine import GenerationRequest

    texts = model.generate_until(_instances("generate_until", [
        ("The capital of France is", {"until": ["."], "max_gen_toks": 8, "do_sample": False})]))
    with GenbackEngine(lm=lm).build() as s:
        direct = s.generate([GenerationRequest(prompt="The capital of France is", max_new_tokens=8,
                                               stop=[".", lm.tokenizer.eos_token])])[0].text
        rolling = s.loglikelihood_rolling([RollingLoglikelihoodRequest("Short text.")])[0].logprob
    assert texts == [direct] and direct == " Paris"
    got = model.loglikelihood_rolling(_instances("loglikelihood_rolling", [("Short text.",)]))
    assert got == [pytest.approx(rolling, abs=1e-4)]  # SmolLM2: cached vs fresh paths
    model.close()


def test_lm_eval_command_line(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    out = subprocess.run(
        [sys.executable, "-m", "genback.engine.lm_eval_model", "--model", "genback",
         "--model_args", "pretrained=smollm2-135m", "--tasks", "genback_mc",
         "--include_path", str(_task_dir(tmp_path)), "--limit", "4"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"\|\s*genback_mc\s*\|.*\|\s*acc\s*\|", out.stdout), out.stdout[-2000:]


def test_evalution_run_on_local_dataset_folder(lm):
    pytest.importorskip("evalution", reason="Evalution is in the [eval] extra")
    from evalution.benchmarks.arc_easy import ARCEasy

    from genback.engine import GenbackEvalutionEngine

    folder = DATA / "arc_local"
    suite = ARCEasy(dataset_path=str(folder), dataset_name=None, split="test")
    engine = GenbackEvalutionEngine(lm=lm)
    result = engine.model(path="smollm2-135m").run(suite).result()
    rows = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    with GenbackEngine(lm=lm).build() as s:
        score = 0.0
        for row in rows:
            lps = [o.logprob for o in s.loglikelihood([
                LoglikelihoodRequest(f"Question: {row['question']}\nAnswer:", f" {c}")
                for c in row["choices"]["text"]])]
            best = [i for i, lp in enumerate(lps) if lp == max(lps)]
            gold = row["choices"]["label"].index(row["answerKey"])
            score += (gold in best) / len(best)
    test = result.tests[0]
    assert test.metrics["acc,exam"] == pytest.approx(score / len(rows))
    assert result.engine["engine"] == "genback"
    assert result.engine["execution"]["backend"] == "hf"
    assert lm.next_token_logprobs_sync([1, 2]).shape == (lm.vocab_size,)  # lent model stays open


def _cli(*args):
    out = subprocess.run([sys.executable, "-m", "genback.cli", "eval", *args, "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _value(stdout, key):
    return float(re.search(rf"^\s+{key}\s+(\S+)", stdout, flags=re.M).group(1))


def test_genback_eval_command(lm, tmp_path):
    records = tmp_path / "mc.json"
    out = _cli(str(DATA / "mc.jsonl"), "--output", str(records))
    _, scores, acc = _expected_mc(lm)
    assert _value(out, "acc") == pytest.approx(acc, abs=1e-4)
    saved = json.loads(records.read_text())
    for record, expected in zip(saved["records"], scores):
        assert record["logprobs"] == pytest.approx(expected, abs=1e-4)

    out = _cli(str(DATA / "perplexity.jsonl"))
    texts = [json.loads(line)["text"] for line in (DATA / "perplexity.jsonl").read_text().splitlines()]
    with GenbackEngine(lm=lm).build() as s:
        total = sum(o.logprob for o in s.loglikelihood_rolling(
            [RollingLoglikelihoodRequest(t) for t in texts]))
    nbytes = sum(len(t.encode()) for t in texts)
    assert _value(out, "byte_perplexity") == pytest.approx(math.exp(-total / nbytes), rel=1e-3)

    out = _cli(str(DATA / "generation.jsonl"), "--backend", "mock")
    assert _value(out, "prompts") == 3 and "exact_match" in out

    bad = subprocess.run([sys.executable, "-m", "genback.cli", "eval", str(DATA / "passage.txt")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not JSON" in bad.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU fallback")
def test_lm_eval_default_device_falls_back_quietly(lm, caplog):
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    from genback.engine import GenbackLM

    with caplog.at_level("WARNING", logger="genback.engine.lm_eval_model"):
        GenbackLM(lm=lm, device="cuda:0").close()  # lm-eval's default when none was asked for
    assert not caplog.records
    with caplog.at_level("WARNING", logger="genback.engine.lm_eval_model"):
        GenbackLM(lm=lm, device="cuda:1").close()
    assert ["CUDA is not available" in r.getMessage() for r in caplog.records] == [True]
