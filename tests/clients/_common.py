"""Shared start-up of the client programs in this folder.

Each program is run as ``python tests/clients/<program>.py --backend genback|genlm [--scale N]``:

* ``genback``: ``genback.compat.alias_genlm_backend()`` is called first, so the client packages
  (llamppl, genlm-control, genlm-bytes) import genback under the name ``genlm.backend``;
* ``genlm``: nothing is aliased; the clients import genlm-backend 0.3.1 as installed.

The program code after :func:`setup` is the same for both. The model is the embedded SmolLM2-135M
folder (``genback.registry.resolve("smollm2-135m")``, fp32 on CPU), loaded through the client-facing
API: ``genlm.backend.llm.AsyncTransformer.from_name(path)`` or a client's own loader that calls it
(llamppl's ``CachedCausalLM.from_pretrained``, genlm's ``load_model_by_name``). A program prints one line
``RESULT <json>`` on stdout; ``timings`` in it holds wall seconds of its phases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BACKENDS = ("genback", "genlm")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:  # run from a checkout without ``pip install -e .``
    sys.path.insert(1, REPO_ROOT)


def setup(description: str) -> argparse.Namespace:
    """Parse ``--backend``, pin one torch thread, install the alias for ``genback``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--scale", type=int, default=1,
                        help="multiply the program's particles (and llamppl's tokens); tests use 1")
    args = parser.parse_args()
    if args.scale < 1:
        parser.error(f"--scale must be >= 1, got {args.scale}")
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    if args.backend == "genback":
        import genback.compat

        genback.compat.alias_genlm_backend()
    import torch

    torch.set_num_threads(1)
    args.timings = {"setup": time.perf_counter() - t0}
    args.t_start = t0
    return args


def seed_all(seed: int) -> None:
    """Seed every RNG the clients draw from: ``random``, numpy's global RNG and torch's."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_path() -> str:
    """The local folder of the embedded SmolLM2-135M-Instruct (fp32 safetensors)."""
    from genback.registry import resolve

    return resolve("smollm2-135m")


def load_lm():
    """``genlm.backend.llm.AsyncTransformer.from_name(path)`` (whichever backend is aliased)."""
    from genlm.backend.llm import AsyncTransformer

    return AsyncTransformer.from_name(model_path())


@contextlib.contextmanager
def phase(args, name: str):
    """``with phase(args, "load"):`` adds the block's wall seconds to ``args.timings[name]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        args.timings[name] = args.timings.get(name, 0.0) + time.perf_counter() - t


def emit(args, result: dict) -> None:
    """Print ``RESULT <json>`` with the backend, the module ``genlm.backend`` came from and timings."""
    backend_mod = sys.modules.get("genlm.backend")
    result = {
        "backend": args.backend,
        "genlm_backend_module": getattr(backend_mod, "__file__", None) or repr(backend_mod),
        "timings": {k: round(v, 3) for k, v in args.timings.items()},
        "total_s": round(time.perf_counter() - args.t_start, 3),
        **result,
    }
    print("RESULT " + json.dumps(result), flush=True)
