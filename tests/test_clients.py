"""Existing clients run unchanged on genback: llamppl, genlm-control and genlm-bytes programs.

Each program in ``tests/clients/`` is run in its own process twice: once with
``genback.compat.alias_genlm_backend()`` (the clients import genback as ``genlm.backend``) and once
on genlm-backend 0.3.1 itself. Both runs use the real SmolLM2-135M (fp32, CPU) and the same seeds.

Checked: the client program's own invariants on genback (constraints hold, runs repeat), and
against genlm-backend: the same samples (the clients draw from numpy / torch RNGs seeded alike, so
equal rows give equal draws unless a near-tie flips) and log-probabilities / log-marginal-likelihood
estimates within 1e-3.

Needs ``pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt``; each test
skips with the reason when a client package (or, for the comparisons, genlm-backend) is missing.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _client_packages import INSTALL
from _client_packages import installed as _installed

pytestmark = pytest.mark.slow

CLIENTS = Path(__file__).parent / "clients"
REPO = Path(__file__).parent.parent
TOL = 1e-3  # log-probabilities and log-marginal-likelihood estimates, genback vs genlm-backend

NEEDS = {  # program -> distributions it imports
    "llamppl_smc": ("llamppl",),
    "control_samplers": ("genlm-control", "genlm-grammar"),
    "bytes_bytellm": ("genlm-control", "genlm-bytes"),
}


def _require(program: str, backend: str) -> None:
    missing = [d for d in NEEDS[program] if not _installed(d)]
    if backend == "genlm" and not _installed("genlm-backend"):
        missing.append("genlm-backend")
    if missing:
        pytest.skip(f"{program} needs {', '.join(missing)} ({INSTALL})")


_RESULTS: dict = {}


def run_program(program: str, backend: str) -> dict:
    """Run ``tests/clients/<program>.py --backend <backend>`` once per session; its RESULT json."""
    _require(program, backend)
    key = (program, backend)
    if key not in _RESULTS:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.run(
            [sys.executable, str(CLIENTS / f"{program}.py"), "--backend", backend],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=900,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(
                f"{program} --backend {backend} exited {proc.returncode}\n"
                f"stdout tail:\n{proc.stdout[-2000:]}\nstderr tail:\n{proc.stderr[-4000:]}"
            )
        _RESULTS[key] = json.loads(lines[-1][len("RESULT "):])
    return _RESULTS[key]


def _check_backend_module(result: dict) -> None:
    """The program really imported what it was asked to: the alias, or genlm-backend's files."""
    where = result["genlm_backend_module"]
    if result["backend"] == "genback":
        assert where == "<module 'genlm.backend'>", where  # the facade has no __file__
    else:
        assert where.replace(os.sep, "/").endswith("genlm/backend/__init__.py"), where


def _assert_close(a: float, b: float, what: str, tol: float = TOL) -> None:
    assert math.isfinite(a) and math.isfinite(b), (what, a, b)
    assert abs(a - b) <= tol, f"{what}: genback {a!r} vs genlm-backend {b!r} (|diff| > {tol})"


# --------------------------------------------------------------------------------------- llamppl


def test_llamppl_smc_on_genback_respects_its_constraint_and_repeats_across_event_loops():
    r = run_program("llamppl_smc", "genback")
    _check_backend_module(r)
    first, second = r["runs"]
    for run in r["runs"]:
        assert len(run["tokens"]) == r["n_particles"]
        for text, toks in zip(run["texts"], run["tokens"]):
            assert "e" not in text.lower(), text  # every token was drawn under the no-"e" mask
            assert 1 <= len(toks) <= r["max_tokens"]
        assert all(w <= 0 for w in run["weights"]), run["weights"]  # mask probabilities <= 1
        assert math.isfinite(run["log_ml"])
    # the second asyncio.run loop on the same model object, same seeds: same particles (its rows
    # come from the caches the first loop filled) and the same weights
    assert second["tokens"] == first["tokens"]
    for a, b in zip(first["weights"], second["weights"]):
        _assert_close(a, b, "weight, loop 2 vs loop 1", 1e-5)


def test_llamppl_smc_matches_genlm_backend():
    ours, ref = run_program("llamppl_smc", "genback"), run_program("llamppl_smc", "genlm")
    _check_backend_module(ref)
    for i, (a, b) in enumerate(zip(ours["runs"], ref["runs"])):
        assert a["tokens"] == b["tokens"], f"run {i}: different particles"
        for wa, wb in zip(a["weights"], b["weights"]):
            _assert_close(wa, wb, f"run {i} particle weight")
        _assert_close(a["log_ml"], b["log_ml"], f"run {i} log-ml")


# --------------------------------------------------------------------------------- genlm-control


def test_control_samplers_on_genback_only_produce_strings_of_the_regex():
    r = run_program("control_samplers", "genback")
    _check_backend_module(r)
    pattern = re.compile(r["regex"])
    assert set(r["samplers"]) == {"eager", "topk", "awrs"}
    for name, s in r["samplers"].items():
        assert len(s["texts"]) == r["n_particles"]
        for text, w in zip(s["texts"], s["log_weights"]):
            if w == -math.inf:
                continue  # a particle that ran out of tokens is dropped with weight 0
            assert text.endswith("<EOS>"), (name, text)
            assert pattern.fullmatch(text[: -len("<EOS>")]), (name, text)
        assert math.isfinite(s["log_ml"]), (name, s)


def test_control_samplers_match_genlm_backend():
    ours, ref = run_program("control_samplers", "genback"), run_program("control_samplers", "genlm")
    _check_backend_module(ref)
    for name in ("eager", "topk", "awrs"):
        a, b = ours["samplers"][name], ref["samplers"][name]
        assert a["texts"] == b["texts"], f"{name}: different samples"
        for wa, wb in zip(a["log_weights"], b["log_weights"]):
            _assert_close(wa, wb, f"{name} particle log-weight")
        _assert_close(a["log_ml"], b["log_ml"], f"{name} log-ml")


# ----------------------------------------------------------------------------------- genlm-bytes


def test_bytellm_log_probabilities_on_genback_are_consistent():
    r = run_program("bytes_bytellm", "genback")
    _check_backend_module(r)
    # byte prefixes can only lose probability as they grow; ending the sequence costs more
    assert r["prefix_logp"] <= r["first_word_logp"] <= 0.0
    assert r["complete_logp"] <= r["prefix_logp"]
    # chain rule: the next-byte log-probability of the reply's last byte is the step between the
    # two prefixes (up to the beam's pruning between steps, hence the loose tolerance)
    last = repr(bytes(r["reply"].encode()[-1:]))
    top = dict(r["next_top"])
    assert last in top, (last, top)
    _assert_close(r["first_word_logp"] + top[last], r["prefix_logp"], "prefix chain rule", 1e-3)


def test_bytellm_matches_genlm_backend():
    ours, ref = run_program("bytes_bytellm", "genback"), run_program("bytes_bytellm", "genlm")
    _check_backend_module(ref)
    for key in ("prefix_logp", "complete_logp", "first_word_logp"):
        _assert_close(ours[key], ref[key], key)
    assert [t for t, _ in ours["next_top"]] == [t for t, _ in ref["next_top"]]
    for (t, a), (_, b) in zip(ours["next_top"], ref["next_top"]):
        _assert_close(a, b, f"next-byte weight of {t}")
