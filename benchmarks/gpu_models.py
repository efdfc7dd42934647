"""Random-weight Llama models of real shapes and device measurements for ``bench_gpu.py``.

No weights can be downloaded on the GPU machines, and speed does not depend on the weights'
values, so the benchmark builds ``LlamaForCausalLM`` from a config with the published dimensions
and random weights, directly on the device in the benchmark dtype (bf16 on CUDA).

Shapes (facts from the public ``config.json`` of each model on the Hugging Face Hub):

* ``llama-3.2-1b``: meta-llama/Llama-3.2-1B. 1.24 B parameters, embeddings tied to the head.
* ``llama-3.1-8b``: meta-llama/Llama-3.1-8B. 8.03 B parameters, untied head.
* ``tiny``: 2 layers, hidden 64, GPT-2's vocabulary padded to 50,304 (the rows are wider than
  the tokenizer, as Llama-3's are): the CPU smoke test.

Peaked distributions. With ``initializer_range`` 0.02 a random model's attention and next-token
distributions are close to uniform, unlike a trained model's. :func:`peak` rescales two weights:

* ``q_proj`` by ``ATTN_SCORE_STD / (0.02**2 * hidden)``. The inputs of ``q_proj``/``k_proj`` are
  RMS-normalised (unit variance per entry), so q and k entries have std ``0.02 * sqrt(hidden)``
  and a score ``q.k / sqrt(head_dim)`` has std ``0.02**2 * hidden``; after scaling it is
  ``ATTN_SCORE_STD`` = 3 (softmax over 1,000 keys: entropy about 2.4 nats instead of 6.9).
* the final norm's weight, so that the logits have std ``LOGIT_STD`` = 4.5 (measured on one
  forward); a trained LM's next-token entropy is a few nats. Measured on the tiny shape over
  300 random tokens: next-token entropy 3.6 nats (uniform: ln 50,304 = 10.8), attention entropy
  of the last query 0.7-4.2 nats per head (uniform over 300 keys: 5.7). Scaling the norm rather
  than the head works for tied embeddings too and does not change the bytes read.
"""

from __future__ import annotations

import time

import torch

LLAMA3_ROPE_BASE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}

SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE_BASE, "factor": 32.0},
        tie_word_embeddings=True, hidden_act="silu", bos_token_id=128000, eos_token_id=128001,
        initializer_range=0.02),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE_BASE, "factor": 8.0},
        tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001,
        initializer_range=0.02),
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=50304, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=50256, eos_token_id=50256, initializer_range=0.02),
}

ATTN_SCORE_STD = 3.0
LOGIT_STD = 4.5


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """``LlamaForCausalLM`` of ``SHAPES[shape]`` with random weights, built on ``device`` in
    ``dtype`` (no fp32 copy on the way), peaked by :func:`peak`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    config = LlamaConfig(**SHAPES[shape])
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype).eval()
    peak(model)
    return model


@torch.inference_mode()
def peak(model) -> None:
    """Scale ``q_proj`` and the final norm so attention and next-token distributions are peaked
    like a trained model's (see the module docstring)."""
    c = model.config
    q_scale = ATTN_SCORE_STD / (c.initializer_range ** 2 * c.hidden_size)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.mul_(q_scale)
    dev = next(model.parameters()).device
    probe = torch.randint(0, c.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1)).to(dev)
    std = float(model(probe, use_cache=False).logits.float().std())
    model.model.norm.weight.mul_(LOGIT_STD / std)


def weight_bytes(model) -> int:
    """Bytes of weights one decoding step reads: every parameter but the input embedding table
    (only its rows for the new tokens are read), which counts when it is tied to the head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p is not emb or p is head)


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token leaves in every layer (``[layers, 2, kv_heads, head_dim]``)."""
    c = model.config
    p = next(model.parameters())
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * p.element_size()


def step_flops(model, rows: float, context: float) -> float:
    """FLOPs of one decoding step of ``rows`` one-token rows over ``context`` past tokens each:
    ``2 * matmul params * rows`` (every linear layer, head included) plus attention's
    ``4 * layers * heads * head_dim * context * rows`` (QK^T and PV)."""
    c = model.config
    lin = weight_bytes(model) // next(model.parameters()).element_size()
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context * rows
    return 2.0 * lin * rows + attn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_model_args(ap, cuda_shape: str) -> None:
    """``--shape``, ``--device`` and ``--dtype`` of a benchmark over these shapes, on the
    ``argparse`` parser ``ap`` (defaults, filled in by :func:`setup`: ``cuda_shape`` and bf16 on
    CUDA, ``tiny`` and fp32 on the CPU)."""
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help=f"random-weight Llama shape (default: {cuda_shape} on CUDA, tiny on CPU)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default bf16 on CUDA, fp32 on the CPU; fp32 runs with TF32 off")


def setup(args, cuda_shape: str) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of :func:`add_model_args`' parsed ``args`` (``args.shape`` filled in
    too); one torch thread on the CPU; TF32 off for fp32 (exact fp32 matmuls on CUDA)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    args.shape = args.shape or (cuda_shape if device.type == "cuda" else "tiny")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    return device, dtype


def measure_device(device: torch.device, dtype: torch.dtype) -> dict:
    """Measured copy bandwidth and matmul rate of ``device``.

    Returns ``{"copy_bytes_per_s", "matmul_flops_per_s"}``: bytes read plus bytes written per
    second by ``dst.copy_(src)`` of 1 GiB (CUDA) / 64 MiB (CPU), and FLOP/s of an ``n x n x n``
    matrix product in ``dtype`` (n = 8192 on CUDA, 1024 on CPU); best of 5 timed runs each.
    """
    cuda = device.type == "cuda"
    n = (1 << 30 if cuda else 64 << 20) // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    m = 8192 if cuda else 1024
    a = torch.randn(m, m, device=device).to(dtype)
    b = torch.randn(m, m, device=device).to(dtype)

    def best(fn, reps):
        fn()
        _sync(device)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            _sync(device)
            times.append((time.perf_counter() - t0) / reps)
        return min(times)

    t_copy = best(lambda: dst.copy_(src), 10 if cuda else 2)
    t_mm = best(lambda: a @ b, 10 if cuda else 1)
    out = {"copy_bytes_per_s": 2 * n * src.element_size() / t_copy,
           "matmul_flops_per_s": 2.0 * m ** 3 / t_mm}
    del src, dst, a, b
    return out


def peak_memory(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` on CUDA; ``None`` elsewhere (not measured)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA's ``mem_get_info``, else MemAvailable of /proc/meminfo."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 40
