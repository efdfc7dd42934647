"""The SMC cells of a GPU session in one short table each (``bench_gpu.py --json`` files).

``gpu_session.sh all`` prints this last, so that the device call's reply (which carries only the
end of its output) holds every cell's figures; the files themselves come back packed. Per file
and cell: each method's particle-tokens/s in the mean over the trace (captures included) and in
steady state (the median step), the host's median ms per step, the GPU's busy ms per step and
the launches per step where profiled (with the captures that fell inside the profile), the
captures, and the error against uncached rows. A file ``<shape>-old.json`` beside
``<shape>-new.json`` (the old code, same call) adds a "vs old" column: the new default method's
mean over the old one's.

Usage: ``python benchmarks/lab/gpu_summary.py OUT_DIR`` (every ``*.json`` of bench_gpu.py in it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def methods(cell: dict) -> list[str]:
    """The cell's genback methods in the order they ran ("genback" first)."""
    return [k for k, v in cell.items() if k.startswith("genback") and isinstance(v, dict)]


def table(data: dict, old: dict | None = None) -> str:
    """One markdown table of a bench_gpu.py JSON document."""
    olds = {(c["particles"], c["prompt"]): c for c in (old or {}).get("cells", [])}
    head = ["N x P", "method", "mean tok/s", "steady tok/s", "steady ms", "host med ms",
            "before / in launch ms", "GPU busy ms", "launches", "captures", "err"] + (["vs old"] if old else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in data.get("cells", []):
        key = (cell["particles"], cell["prompt"])
        for name in methods(cell):
            g = cell[name]
            steady = g.get("steady_particle_tokens_per_s")
            row = [f"{key[0]} x {key[1]}", name, f"{g['particle_tokens_per_s']:.0f}",
                   "-" if steady is None else f"{steady:.0f}",
                   "-" if "steady_step_s" not in g else f"{g['steady_step_s'] * 1e3:.2f}",
                   "-" if "host_median_s" not in g else f"{g['host_median_s'] * 1e3:.2f}",
                   "-" if "host_before_launch_median_s" not in g
                   else (f"{g['host_before_launch_median_s'] * 1e3:.2f} / "
                         f"{g['host_in_launch_median_s'] * 1e3:.2f}"),
                   "-" if "gpu_busy_s_per_step" not in g
                   else f"{g['gpu_busy_s_per_step'] * 1e3:.2f}",
                   "-" if "launches_per_step" not in g else (
                       f"{g['launches_per_step']:.0f}" + (f" ({g['captures_in_profile']} cap.)"
                                                          if g.get("captures_in_profile") else "")),
                   str(g.get("decode_captures", "-")), f"{g['err_vs_uncached']:.2g}"]
            if old:
                was = olds.get(key, {}).get("genback")
                row.append("-" if not was or name != "genback"
                           else f"{g['particle_tokens_per_s'] / was['particle_tokens_per_s']:.2f}x")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(folder: Path) -> str:
    """Every bench_gpu.py JSON under ``folder`` (the old code's beside its new one)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.stem.endswith("-old"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "cells" not in data or "shape" not in data:
            continue  # (not a bench_gpu.py file: the trie's, say)
        old_path = path.with_name(path.stem.removesuffix("-new") + "-old.json")
        old = (json.loads(old_path.read_text())
               if path.stem.endswith("-new") and old_path.exists() else None)
        out.append(f"### {path.name}: {data.get('header', data['shape'])}\n\n{table(data, old)}")
    return "\n\n".join(out) if out else f"no bench_gpu.py JSON under {folder}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/lab/gpu_summary.py OUT_DIR")
    print(summary(Path(sys.argv[1])))
