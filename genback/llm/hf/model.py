"""``AsyncTransformer``: a Hugging Face causal LM behind the auto-batched ``AsyncLM`` API.

The computation is :class:`genback.llm.hf.HFRunner`'s: each batch is planned against the KV
prefix tree, every query forwards only the tokens after its longest cached prefix, and attention
reads each shared tree segment once for all the rows below it (tree attention), so a step of
hundreds of particles over one long prompt costs little more than over a short one.

LoRA adapters (peft) are registered by name (``add_new_lora``) and chosen per query
(``lora_name=``); the KV tree and the row cache are keyed by adapter.
"""

from __future__ import annotations

import torch

from .runner import HFRunner
from ...core.lm import AsyncLM


class AsyncTransformer(AsyncLM):
    """Async, auto-batched next-token log-probs from a Hugging Face causal LM, with KV reuse.

    Args:
        hf_model: a ``transformers`` causal LM (``AutoModelForCausalLM``) in eval mode, on any device.
        hf_tokenizer: its tokenizer.
        batch_size: most distinct queries per batch (>= 1, default 512: every query of an SMC
            step of hundreds of particles joins one batch); settable later.
        timeout: alias of ``batch_window`` kept for genlm-backend callers (seconds).
        batch_window: seconds a batch waits for more queries, from its first query (default 2 ms).
        max_batch_tokens: most new tokens (padding included) one forward computes (>= 1); a
            batch is split into forwards by this and by ``max_forward_bytes``, never by the
            length of whole contexts (a one-token extension of a 4,000-token context is one token).
        max_forward_bytes: bound on one forward's working set in bytes: attention scores and
            the logits of the positions it scores (default: a quarter of free memory, at most
            2 GiB). A query larger than that is answered in forwards that fit (its context
            prefilled in chunks, its continuation scored in slices); one whose single position
            does not fit fails alone with a ``ValueError`` naming the limit.
        kv_budget_bytes: most bytes of KV kept in the prefix tree (default: half of the device's
            free memory at construction); least recently used leaves are evicted beyond it and
            recomputed when asked again. Everything genback keeps of a forward lives in the tree.
        row_cache_size: most next-token rows kept (float32 ``[V]`` each).
        attention: ``"auto"`` (tree attention when the model uses transformers' attention
            interface, else the dense path; ``cache_info()["attention"]`` says which and why),
            ``"tree"`` or ``"dense"``.
        min_shared_tokens: tree attention reads a cached segment under ``n >= 2`` rows of a
            forward once for all of them when it is at least this many tokens long; shorter
            segments are gathered per row (cheaper than a separate attention product).
        row_device: where next-token rows are returned and cached: None (default) for the
            model's device, as genlm-backend returns them (genlm-control's ``PromptedLLM``
            gathers on the row's device; a GPU row never crosses to the host unless asked), or
            ``"cpu"`` for host rows. Scores (``token_logprobs``, ``score``) are always on the
            CPU. Mind the output cache on a GPU: ``row_cache_size`` rows of ``V`` float32 each
            (1,024 x 128,256 x 4 bytes = 525 MB for a Llama-3 vocabulary).
        decode: how a uniform decode step (every query one token after a cached context: an
            SMC or decoding step) runs. ``"auto"`` (default): replayed as a captured CUDA graph
            per bucket on a CUDA device with tree attention, on the tree path elsewhere;
            ``"graphs"`` (CUDA only), ``"eager"`` (the graph's static-buffer code without
            capture, any device) or ``"off"`` (the tree path). See
            :mod:`genback.llm.hf.decode.step`.

    Rows are float32 ``[V]`` on ``row_device``, whatever the model's dtype.

    Raises:
        ValueError: an option out of range.
    """

    def __init__(
        self,
        hf_model,
        hf_tokenizer,
        batch_size: int = 512,
        timeout: float | None = None,
        *,
        batch_window: float = 0.002,
        max_batch_tokens: int = 4096,
        max_forward_bytes: int | None = None,
        kv_budget_bytes: int | None = None,
        row_cache_size: int = 1024,
        attention: str = "auto",
        min_shared_tokens: int = 64,
        row_device=None,
        decode: str = "auto",
    ):
        self.model = hf_model.eval()
        self.device = next(hf_model.parameters()).device
        width = hf_model.get_output_embeddings().weight.shape[0]
        if kv_budget_bytes is not None and (isinstance(kv_budget_bytes, bool) or not isinstance(
                kv_budget_bytes, int) or kv_budget_bytes <= 0):
            raise ValueError(f"kv_budget_bytes must be a positive int, got {kv_budget_bytes!r}")
        runner = HFRunner(hf_model, kv_budget_bytes=kv_budget_bytes,
                          max_batch_tokens=max_batch_tokens, max_forward_bytes=max_forward_bytes,
                          attention=attention, min_shared_tokens=min_shared_tokens,
                          row_device=row_device, decode=decode)
        super().__init__(
            hf_tokenizer,
            runner,
            vocab_size=width,
            batch_size=batch_size,
            batch_window=batch_window if timeout is None else timeout,
            row_cache_size=row_cache_size,
            max_context_length=getattr(hf_model.config, "max_position_embeddings", None),
            eos_token_ids=_config_eos(getattr(hf_model, "generation_config", None)),
        )
        # on a GPU no young collection runs before a step's launch (genback.cpython, trick 4)
        self.scheduler.defer_collections = self.device.type == "cuda"

    @classmethod
    def from_name(cls, model_id: str = "smollm2-135m", bitsandbytes_opts=None, hf_opts=None,
                  **kwargs) -> "AsyncTransformer":
        """Load a model by embedded alias, local folder or Hub id (fp32 on CPU by default).

        Args:
            model_id: ``"smollm2-135m"`` (default), a local HF folder, or a Hub id.
            bitsandbytes_opts: options of a ``BitsAndBytesConfig`` (needs bitsandbytes and CUDA).
            hf_opts: extra ``from_pretrained`` options (e.g. ``{"dtype": torch.bfloat16,
                "device_map": "cuda"}``).
            **kwargs: passed to the constructor.

        Raises:
            genback.registry.ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model
                is not available: an alias whose package is missing, a missing folder, a Hub id
                neither cached nor downloadable; the message says what to install or download.
            ValueError: an empty name or a folder that holds no model.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ...registry import resolve

        path = resolve(model_id)
        opts = {"dtype": torch.float32}
        opts.update(hf_opts or {})
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, **opts)
        except OSError as exc:
            from ...registry import unavailable

            raise unavailable(model_id, exc) from exc
        return cls(model, tokenizer, **kwargs)

    def visualize_cache(self, max_nodes: int = 200, lora_name=None):
        """A picture of the KV tree (``graphviz.Digraph``): one box per node with its token
        count, KV bytes and how many recently asked contexts end at or below it (pinned nodes
        double-bordered), edges labelled with their decoded text, the prompt shortened. Shows
        which prefixes particles share, where resampling collapsed them, what a prompt's reuse
        looks like. Building it needs the ``graphviz`` package only; ``.render()`` / ``.pipe()``
        need Graphviz's ``dot`` program. See :func:`genback.llm.hf.cache.picture.draw`.

        Args:
            max_nodes: most nodes drawn (depth first); a note counts the rest.
            lora_name: the adapter whose tree is drawn (None: the base model's).

        Raises:
            ImportError: ``graphviz`` is not installed. ValueError: ``max_nodes < 1`` or an
                unknown ``lora_name``.
        """
        adapter = self._lora_key(lora_name)
        with self.front.lock:
            return self.runner.picture(self.tokenizer.decode, max_nodes, adapter)

    def walk_cache(self, token_ids, lora_name=None):
        """genlm-backend's view of the KV cache: how much of ``token_ids`` has cached KV.

        Returns:
            The tuple `(node, next_token_index, past, base)`: `node` is the deepest KV-tree node
                on the cached path (:class:`~genback.llm.hf.runner.CachedNode`:
                `node.past_key_values` is its edge's KV `[layers, 2, kv_heads, len(edge),
                head_dim]`, None for a root, as in genlm-backend; `node.slots` its slots in the
                KV pool), `next_token_index` the number of leading tokens whose
                KV is cached, `past` their KV as one new tensor `[layers, 2, kv_heads,
                next_token_index, head_dim]` on the model's device (None when nothing is
                cached), and `base` equal to `next_token_index` (genback keeps the KV of every
                evaluated context, not only of `cache_kv` prompts). Reads without reordering
                the LRU.

        Raises:
            TypeError / ValueError: bad ``token_ids`` or unknown ``lora_name``.
        """
        adapter = self._lora_key(lora_name)
        ids = self._check_ids(token_ids)
        with self.front.lock:
            node, n, past = self.runner.walk(ids, adapter)
        return node, n, past, n

    # -- statistics and reference --------------------------------------------------------------------

    def next_token_logprobs_uncached(self, token_ids, lora_name=None) -> torch.Tensor:
        """Reference: one full forward of ``token_ids`` alone, no cache, no batching, the
        model's own attention implementation.

        Returns float32 ``[V]`` on the rows' device (``row_device``).

        Raises:
            TypeError / ValueError: bad ``token_ids`` or an unknown ``lora_name``.
        """
        adapter = self._lora_key(lora_name)
        ids = self._check_ids(token_ids)
        with self.front.lock:
            return self.runner.uncached_row(ids, adapter)


def _config_eos(config) -> list[int]:
    """The ``eos_token_id`` of a generation config (an int, a list, or absent) as a list."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]

