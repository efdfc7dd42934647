"""lm-eval data parallel on the CPU: ``torchrun --nproc_per_node 2`` over ``GenbackLM`` (gloo).

Two real processes, each with its own SmolLM2, run ``lm_eval.simple_evaluate`` on the local
multiple-choice task of ``tests/data/engine/mc.jsonl``: every request is answered by exactly one
rank, each rank serves half, and rank 0's metrics and per-sample log-likelihoods equal one
process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from genback.engine.data_parallel import DataParallel, launcher_ranks

pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")

from test_engine_harness import _expected_mc, _task_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

RANK_SCRIPT = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
from genback.engine import GenbackLM


class Recording(GenbackLM):  # the real model; it also notes which requests this rank was given
    seen = []

    def _loglikelihood_tokens(self, requests, **kwargs):
        self.seen.extend(list(pair) for pair, _, _ in requests)
        return super()._loglikelihood_tokens(requests, **kwargs)


model = Recording(pretrained="smollm2-135m")
results = lm_eval.simple_evaluate(model=model, tasks=["genback_mc"], log_samples=True,
                                  task_manager=TaskManager(include_path=sys.argv[1]))
out = {"rank": model.rank, "world_size": model.world_size, "seen": model.seen}
if results is not None:  # rank 0 only
    out["acc"] = results["results"]["genback_mc"]["acc,none"]
    out["samples"] = {s["doc_id"]: [r[0][0] for r in s["resps"]]
                      for s in results["samples"]["genback_mc"]}
with open(f"{sys.argv[2]}/rank{model.rank}.json", "w") as f:
    json.dump(out, f)
model.close()
"""


def test_one_process_has_no_ranks(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launcher_ranks() == (0, 1, 0)
    dp = DataParallel()
    assert (dp.rank, dp.world_size) == (0, 1)
    assert dp.gather_object({"a": 1}) == [{"a": 1}]
    dp.barrier()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        launcher_ranks()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        launcher_ranks()


@pytest.mark.slow
def test_torchrun_two_cpu_ranks_split_the_requests_and_match_one_process(module_smol_lm, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task_dir(tasks)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tasks), str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]

    rows, scores, acc = _expected_mc(module_smol_lm)
    everything = Counter((r["context"], c) for r in rows for c in r["choices"])
    answered = Counter(tuple(pair) for r in ranks for pair in r["seen"])
    assert answered == everything  # every request exactly once, across the ranks
    assert [len(r["seen"]) for r in ranks] == [len(everything) // 2] * 2  # half each
    assert "acc" not in ranks[1]  # only rank 0 holds the results
    assert ranks[0]["acc"] == pytest.approx(acc, abs=1e-6)
    samples = ranks[0]["samples"]
    assert sorted(int(d) for d in samples) == list(range(len(rows)))
    for doc, expected in enumerate(scores):
        assert samples[str(doc)] == pytest.approx(expected, abs=1e-4)
