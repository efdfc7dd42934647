"""lm-evaluation-harness model ``"genback"`` (needs ``lm_eval``, the ``[eval]`` extra).

``GenbackLM`` is a ``lm_eval.api.model.TemplateLM``: lm-eval itself tokenizes
``(context, continuation)`` pairs (trailing-whitespace move, joint encoding, prefix token for an
empty context) and hands the ids to ``_loglikelihood_tokens``, which scores them on a
:class:`~genback.engine.session.GenbackSession` (so choices of one question share their
context's KV). ``loglikelihood_rolling`` and ``generate_until`` go through the session too.

Use from Python::

    import lm_eval
    from genback.engine import GenbackLM
    lm_eval.simple_evaluate(model=GenbackLM(pretrained="smollm2-135m"), tasks=[...])
    # or, after genback.engine.register_lm_eval():  model="genback",
    #     model_args="pretrained=smollm2-135m,backend=hf"

and from the command line (``lm_eval``'s own CLI, with the model registered first)::

    python -m genback.engine.lm_eval_model --model genback \
        --model_args pretrained=smollm2-135m --tasks hellaswag --limit 50
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from . import _missing_extra

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
except ImportError as _exc:
    raise _missing_extra("genback.engine.GenbackLM (the lm-eval model 'genback')",
                        "lm-evaluation-harness (PyPI: lm-eval)", "lm_eval", _exc) from _exc

from .data_parallel import DataParallel, launcher_ranks
from .encoding import encode_pairs, encode_text, prefix_token_id
from .engine import GenbackEngine
from .types import GenerationRequest, RollingLoglikelihoodRequest

__all__ = ["GenbackLM", "register_lm_eval"]

log = logging.getLogger(__name__)

# lm-eval generation kwargs that genback's generation config takes (GenerationRequest.metadata)
_GEN_KWARGS = ("top_k", "top_p", "min_p", "seed", "min_new_tokens", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "no_repeat_ngram_size")


class GenbackLM(TemplateLM):
    """lm-eval model over genback.

    Args:
        pretrained: embedded alias, local folder or Hub id (default ``"smollm2-135m"``).
        backend: ``"hf"``, ``"vllm"`` or ``"mock"``.
        lm: an already loaded ``AsyncLM`` (then ``pretrained`` / ``backend`` are not used and
            the model is not closed with this object).
        max_length: model window in tokens (default: the model's).
        max_gen_toks: default most new tokens for ``generate_until`` (256, as lm-eval).
        batch_size: lm-eval's option, accepted and not used: genback's own batcher decides how
            requests share forwards (at lm-eval's default ``batch_size=1`` as at any other), so
            it is not a throttle. Bound the requests in flight with ``max_in_flight``.
        max_in_flight: most requests of one call in flight at once (default 256).
        device: lm-eval's ``--device``; for the hf backend a non-CPU device becomes
            ``hf_opts={"device_map": device}`` unless ``hf_opts`` is given. Without CUDA a CUDA
            device falls back to the CPU (as ``HFLM`` does); only a device the user asked for
            is warned about, not lm-eval's own default ``"cuda:0"``.
        max_batch_size: accepted for lm-eval's CLI and not used (batches are formed by genback).

    Under ``torchrun`` / ``accelerate launch`` (``WORLD_SIZE`` > 1) each process is one rank:
    it loads its own model (on ``cuda:LOCAL_RANK`` when CUDA is available and no other device
    was asked for, else on the CPU), joins the default process group (NCCL on GPUs, gloo on the
    CPU), and lm-eval's evaluator gives it its share of the requests and gathers the results
    on rank 0, which writes them (``rank``, ``world_size``, ``all_gather``, ``gather_object``,
    ``barrier``).
        **llm_opts: options for the backend's ``from_name``.
    """

    def __init__(self, pretrained: str = "smollm2-135m", backend: str = "hf", lm=None,
                 max_length: int | None = None, max_gen_toks: int = 256, batch_size=None,
                 max_batch_size=None, device=None, max_in_flight: int = 256, **llm_opts):
        super().__init__()
        if isinstance(max_in_flight, str) and max_in_flight.isdigit():  # from --model_args
            max_in_flight = int(max_in_flight)
        _, world, local_rank = launcher_ranks()
        if world > 1 and (device is None or str(device) in (_LM_EVAL_DEFAULT_DEVICE, "cuda")):
            device = DataParallel.rank_device(local_rank)  # each rank on its own device
        model_device = "cpu"
        if _usable_device(device) and lm is None and backend == "hf" and "hf_opts" not in llm_opts:
            llm_opts["hf_opts"] = {"device_map": device}
            model_device = str(device)
        engine = GenbackEngine(backend=backend, lm=lm, llm_opts=llm_opts, max_length=max_length,
                               max_in_flight=max_in_flight, errors="raise")
        self.session = engine.build(pretrained)
        # under torchrun / accelerate launch: this rank's place (lm-eval's evaluator splits the
        # requests by rank and gathers the results on rank 0 through the methods below)
        self._dp = DataParallel(device=model_device)
        self._rank, self._world_size, self._device = self._dp.rank, self._dp.world_size, model_device
        self.tokenizer = self.session.tokenizer
        self.pretrained = pretrained
        self.max_gen_toks = max_gen_toks

    # -- what TemplateLM needs ----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return prefix_token_id(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self.session.max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", str(self.pretrained)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            return encode_text(self.tokenizer, string)
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tokenizer.decode(tokens, **kwargs)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``[(logprob, is_greedy)]`` of lm-eval's ``loglikelihood`` requests (``req.args =
        (context, continuation)``): ``TemplateLM.loglikelihood``'s encoding (the same ids), with
        each distinct text encoded once, in batched tokenizer calls
        (:func:`~genback.engine.encoding.encode_pairs`), then :meth:`_loglikelihood_tokens`."""
        pairs = [tuple(req.args) for req in requests]
        encoded = encode_pairs(self.tokenizer, pairs)
        return self._loglikelihood_tokens(
            [(pair, ctx, cont) for pair, (ctx, cont) in zip(pairs, encoded)],
            disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``[(logprob, is_greedy)]`` for ``[((context, continuation), ctx_ids, cont_ids)]``;
        pairs longer than the window are truncated on the left as ``HFLM`` does; a
        continuation longer than the window raises ``ValueError`` (``HFLM`` asserts)."""
        # lm-eval's own ids: not re-checked item by item; the session truncates to its window
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        with tqdm(total=len(pairs), desc="genback loglikelihood", disable=disable_tqdm) as bar:
            outs = self.session.loglikelihood_tokens(pairs, progress=bar.update)
        results = [(o.logprob, o.is_greedy) for o in outs]
        for (pair, _, _), res in zip(requests, results):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-prob of each request's text (``req.args[0]``) in lm-eval's disjoint rolling
        windows at the model's window (:func:`genback.queries.window.rolling_windows`).

        Raises:
            ValueError: a text that tokenizes to no tokens (the run stops, as with ``HFLM``).
        """
        texts = [req.args[0] for req in requests]
        outs = self.session.loglikelihood_rolling([RollingLoglikelihoodRequest(t) for t in texts])
        for text, out in zip(texts, outs):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out.logprob)
        return [out.logprob for out in outs]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The generated text of each request (``req.args = (context, gen_kwargs)``), greedy
        unless ``do_sample``; stops at ``until`` strings, EOS or ``max_gen_toks``.

        Raises:
            TypeError / ValueError: bad ``gen_kwargs`` (from lm-eval's normalisation or
                genback's generation config), or a prompt longer than the window.
        """
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        items = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            meta = {k: kw[k] for k in _GEN_KWARGS if kw.get(k) is not None}
            items.append((i, GenerationRequest(
                prompt=context, stop=until, max_new_tokens=int(kw.pop("max_gen_toks")),
                do_sample=bool(kw.get("do_sample", False)),
                temperature=float(kw.get("temperature", 0.0) or 0.0), metadata=meta)))
        results: list = [None] * len(items)
        bar = tqdm(total=len(items), desc="genback generate_until", disable=disable_tqdm)
        for i, out in self.session.generate_continuous(items):
            results[i] = out.text
            self.cache_hook.add_partial("generate_until", requests[i].args, out.text)
            bar.update(1)
        bar.close()
        return results

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """The chat rendered with the tokenizer's template (a str, not ids).

        Raises:
            ValueError: the tokenizer has no chat template (from transformers).
        """
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template=False):
        if chat_template is False or chat_template is None:
            return None
        return getattr(self.tokenizer, "chat_template", None)

    # -- data parallelism (lm-eval's LM primitives; no-ops in one process) ------------------------

    def all_gather(self, tensor):
        """Every rank's ``tensor`` concatenated in rank order (lm-eval pads ranks with it)."""
        return self._dp.all_gather(tensor)

    def gather_object(self, obj, dst: int = 0):
        """Every rank's ``obj`` in rank order on rank ``dst``, ``None`` on the others."""
        return self._dp.gather_object(obj, dst=dst)

    def barrier(self) -> None:
        """Wait for every rank."""
        self._dp.barrier()

    def close(self) -> None:
        """Close the genback session (idempotent)."""
        self.session.close()


# what lm-eval passes as ``device`` when the user gave none (its EvaluatorConfig default)
_LM_EVAL_DEFAULT_DEVICE = "cuda:0"


def _usable_device(device) -> bool:
    """Whether to place the model on ``device``; an unusable CUDA device falls back to the CPU
    with a warning only when the user asked for it (not lm-eval's own default)."""
    if not device or str(device) == "cpu":
        return False
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            level = logging.DEBUG if str(device) == _LM_EVAL_DEFAULT_DEVICE else logging.WARNING
            log.log(level, "device %r requested but CUDA is not available: using the CPU", device)
            return False
    return True


def register_lm_eval() -> type[GenbackLM]:
    """Register ``GenbackLM`` as lm-eval model ``"genback"`` (idempotent); returns the class.

    lm-eval's built-in models are registered first: its registry only loads them lazily when
    it is empty, so registering into an empty registry would hide them.
    """
    import lm_eval.models  # noqa: F401  (registers the built-in models)

    if model_registry.get("genback", None) is not GenbackLM:
        model_registry.register("genback", target=GenbackLM)
    return GenbackLM


register_lm_eval()


def main() -> None:
    """``lm_eval``'s command line with the ``genback`` model registered.

    Raises:
        SystemExit: lm-eval's own exits (argument errors, ``--help``); other errors of the run
            propagate with their traceback (``genback lm-eval`` prints them in one line).
    """
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()  # reads sys.argv (lm-eval inserts its "run" subcommand when none is given)


if __name__ == "__main__":
    main()
