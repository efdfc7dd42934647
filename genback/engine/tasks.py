"""Local JSONL evaluation tasks (the ``genback eval`` command).

One JSON object per line; the task kind follows from the keys (every line must agree):

* multiple choice: ``{"context": str, "choices": [str, ...], "answer": int | str}``; each choice
  is scored as the continuation of the context (text appended as is: put the leading space in
  the choice). Metrics: ``acc`` (highest log-likelihood) and ``acc_norm`` (highest
  log-likelihood per character of the choice, lm-eval's ``acc_norm``).
* perplexity: ``{"text": str}``. Metrics over all texts: ``token_perplexity``,
  ``word_perplexity`` (per whitespace-separated word), ``byte_perplexity`` and
  ``bits_per_byte`` (per UTF-8 byte), as lm-eval's perplexity tasks define them.
* generation: ``{"prompt": str}`` or ``{"messages": [...]}``, optional ``"target"``, ``"stop"``,
  ``"max_new_tokens"``. Metric: ``exact_match`` (stripped text equals the stripped target) over
  the lines that have a target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .types import GenerationRequest, LoglikelihoodRequest, RollingLoglikelihoodRequest

__all__ = ["KINDS", "load_task", "run_task"]

KINDS = ("multiple_choice", "perplexity", "generation")


def _kind(row: dict) -> str | None:
    if "choices" in row:
        return "multiple_choice"
    if "prompt" in row or "messages" in row:
        return "generation"
    if "text" in row:
        return "perplexity"
    return None


def load_task(path, kind: str | None = None, limit: int | None = None) -> tuple[str, list[dict]]:
    """``(kind, rows)`` of a JSONL task file.

    Raises:
        ValueError: unreadable JSON, a line of another kind, a bad ``kind`` or field (the message
            names the file and line).
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    rows, found = [], kind
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            k = _kind(row)
            if found is None:
                found = k
            if k is None or k != found:
                raise ValueError(_mismatch(path, n, row, k, found))
            if k == "multiple_choice":
                _check_mc(row, f"{path}:{n}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no task lines")
    return found, rows


def _check_mc(row: dict, where: str) -> None:
    choices, answer = row.get("choices"), row.get("answer")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{where}: choices must be a list of at least two strings, got {choices!r}")
    if isinstance(answer, str):
        if answer not in choices:
            raise ValueError(f"{where}: answer {answer!r} is not one of the choices")
    elif isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"{where}: answer must be a choice index in [0, {len(choices)}) or a "
                         f"choice string, got {answer!r}")


def _progress(pairs, total: int, desc: str, progress: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, disable=not progress, unit="req")
    for item in pairs:
        bar.update(1)
        yield item
    bar.close()


def run_task(session, kind: str, rows: list[dict], *, max_new_tokens: int = 64,
             progress: bool = True) -> tuple[dict, list[dict]]:
    """Run a task on a session; returns ``(summary metrics, per-line records)``."""
    if kind == "multiple_choice":
        return _run_mc(session, rows, progress)
    if kind == "perplexity":
        return _run_ppl(session, rows, progress)
    if kind == "generation":
        return _run_gen(session, rows, max_new_tokens, progress)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _run_mc(session, rows, progress):
    items = [((i, j), LoglikelihoodRequest(row.get("context", ""), choice))
             for i, row in enumerate(rows) for j, choice in enumerate(row["choices"])]
    from tqdm import tqdm

    scores: dict = {}
    errors = 0
    step = 8 * session.max_in_flight  # the session orders each call for sharing; the bar moves per call
    with tqdm(total=len(items), desc="multiple choice", disable=not progress, unit="req") as bar:
        for start in range(0, len(items), step):
            chunk = items[start:start + step]
            for (key, _), out in zip(chunk, session.loglikelihood([r for _, r in chunk])):
                scores[key] = out.logprob
                errors += "error" in out.metadata
            bar.update(len(chunk))
    records, acc, acc_norm = [], 0, 0
    for i, row in enumerate(rows):
        choices = row["choices"]
        lps = [scores[(i, j)] for j in range(len(choices))]
        gold = row["answer"] if isinstance(row["answer"], int) else choices.index(row["answer"])
        pred = max(range(len(choices)), key=lambda j: lps[j])
        norm = max(range(len(choices)), key=lambda j: lps[j] / max(1, len(choices[j])))
        acc += pred == gold
        acc_norm += norm == gold
        records.append({"index": i, "logprobs": lps, "prediction": pred, "gold": gold})
    n = len(rows)
    return {"kind": "multiple_choice", "questions": n, "requests": len(items),
            "acc": acc / n, "acc_norm": acc_norm / n, "errors": errors}, records


def _run_ppl(session, rows, progress):
    requests = [RollingLoglikelihoodRequest(row["text"]) for row in rows]
    outs: dict = {}
    # rolling requests are independent: score them in chunks so the bar moves
    chunk = 8
    from tqdm import tqdm

    with tqdm(total=len(rows), desc="perplexity", disable=not progress, unit="text") as bar:
        for start in range(0, len(requests), chunk):
            for k, out in enumerate(session.loglikelihood_rolling(requests[start:start + chunk])):
                outs[start + k] = out
            bar.update(min(chunk, len(requests) - start))
    total = math.fsum(outs[i].logprob for i in range(len(rows)))
    tokens = sum(outs[i].token_count for i in range(len(rows)))
    words = sum(len(row["text"].split()) for row in rows)
    nbytes = sum(len(row["text"].encode("utf-8")) for row in rows)
    records = [{"index": i, "logprob": outs[i].logprob, "tokens": outs[i].token_count}
               for i in range(len(rows))]

    def ppl(n):
        return math.exp(-total / n) if n else float("nan")

    return {"kind": "perplexity", "texts": len(rows), "tokens": tokens, "logprob": total,
            "token_perplexity": ppl(tokens), "word_perplexity": ppl(words),
            "byte_perplexity": ppl(nbytes),
            "bits_per_byte": -total / (nbytes * math.log(2)) if nbytes else float("nan")}, records


def _run_gen(session, rows, max_new_tokens, progress):
    items = []
    for i, row in enumerate(rows):
        items.append((i, GenerationRequest(
            prompt=row.get("prompt"), messages=row.get("messages"), stop=list(row.get("stop", [])),
            max_new_tokens=int(row.get("max_new_tokens", max_new_tokens)),
            do_sample=bool(row.get("do_sample", False)),
            temperature=float(row.get("temperature", 0.0)),
            metadata={k: row[k] for k in ("seed", "top_k", "top_p") if k in row})))
    outs: dict = {}
    for i, out in _progress(session.generate_continuous(items), len(items), "generation", progress):
        outs[i] = out
    records, hits, scored = [], 0, 0
    for i, row in enumerate(rows):
        out = outs[i]
        record = {"index": i, "text": out.text, "finish_reason": out.metadata.get("finish_reason"),
                  "completion_tokens": out.metadata.get("completion_tokens")}
        if "target" in row:
            record["exact_match"] = out.text.strip() == str(row["target"]).strip()
            hits += record["exact_match"]
            scored += 1
        records.append(record)
    summary = {"kind": "generation", "prompts": len(rows),
               "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
               "errors": sum(r["finish_reason"] == "error" for r in records)}
    if scored:
        summary["exact_match"] = hits / scored
    return summary, records


def write_records(path, summary: dict, records: list[dict]) -> None:
    """Write ``{"summary": ..., "records": [...]}`` as JSON to ``path``."""
    Path(path).write_text(json.dumps({"summary": summary, "records": records}, indent=1))


def _mismatch(path, n: int, row: dict, kind: str | None, task_kind: str | None) -> str:
    """The message for line ``n`` whose keys make no known kind (``kind`` None), or another
    kind than the task's first line."""
    keys = f"keys {sorted(row)}"
    if kind is None:
        return (f"{path}:{n}: a line of no known kind ({keys}): a multiple-choice line has "
                "\"choices\", a generation line \"prompt\" or \"messages\", a perplexity line "
                "\"text\"; see genback.engine.tasks for the formats")
    return (f"{path}:{n}: a {kind} line ({keys}) in a {task_kind} task: every line of a file "
            "must be of the kind of its first line")
