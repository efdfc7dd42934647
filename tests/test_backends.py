"""One table of backends: load_model_by_name, the engine and the command line agree."""

from __future__ import annotations

import pytest

from genback import llm
from genback.llm.backends import BACKEND_NAMES, BACKENDS, backend_class, check_backend
from genback.cli.parser import build_parser
from genback.engine import GenbackEngine


def test_every_backend_is_served_everywhere():
    assert BACKEND_NAMES == ("hf", "vllm", "mlx", "mock")
    assert set(llm._BACKENDS) == set(BACKEND_NAMES)  # load_model_by_name's own check
    for name in BACKEND_NAMES:
        assert GenbackEngine(backend=name).backend == name
        assert issubclass(backend_class(name), llm.AsyncLM)
        args = build_parser().parse_args(["logprobs", "x", "--backend", name])
        assert args.backend == name
    assert backend_class("mlx") is llm.AsyncMlxLM and BACKENDS["vllm"].install


@pytest.mark.parametrize("bad", ["nope", "", None, "HF"])
def test_unknown_backend_is_refused_with_the_names(bad):
    with pytest.raises(ValueError, match=r"backend must be one of \('hf', 'vllm', 'mlx', 'mock'\)"):
        check_backend(bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        GenbackEngine(backend=bad)
    with pytest.raises(ValueError, match="backend must be one of"):
        llm.load_model_by_name("smollm2-135m", backend=bad or "nope")
