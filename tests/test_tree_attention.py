"""Tree attention's pieces against brute force: the masked part (fused and materialised), the
shared-segment part, and their log-sum-exp merge, compared with one softmax over all keys."""

from __future__ import annotations

import pytest
import torch

from genback.llm.hf.forward import attention as T

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _brute(q, k, v, bias, scale):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale + bias.double()
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("R,G,m,P", [(3, 1, 1, 5), (4, 3, 2, 7), (2, 2, 5, 0)])
def test_masked_part_and_merge_equal_one_softmax(device, kernel, R, G, m, P):
    torch.manual_seed(R * 100 + G * 10 + m + P)
    Hkv, D, L_shared = 2, 16, 9
    L = P + m
    # a TreeBatch's mask: left-padded private past (pad_r columns off), causal new block
    mask = torch.ones((R, 1, m, L), dtype=torch.bool)
    mask[:, :, :, P:] = torch.ones((m, m), dtype=torch.bool).tril()
    for r in range(R):
        mask[r, 0, :, : min(r, P)] = False
    batch = T.TreeBatch([], None, None, None, P, mask.to(device))
    bias = batch.bias(G, torch.float32)
    assert bias.shape == (R, 1, G * m, L) and bias.stride(-2) % 16 == 0
    assert batch.bias(G, torch.float32) is bias  # built once per forward
    q = torch.randn(R, Hkv, G * m, D, device=device)
    k, v = torch.randn(R, Hkv, L, D, device=device), torch.randn(R, Hkv, L, D, device=device)
    out, lse = T._attend(q, k, v, 0.25, kernel, bias)
    want, want_lse = _brute(q, k, v, bias, 0.25)
    assert out.shape == (R, Hkv, G * m, D) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)

    # a shared segment every row reads, merged: equal to one softmax over [shared, private]
    ks, vs = torch.randn(Hkv, L_shared, D, device=device), torch.randn(Hkv, L_shared, D, device=device)
    qs = q.transpose(0, 1).reshape(1, Hkv, R * G * m, D)
    o_s, l_s = T._attend(qs, ks[None], vs[None], 0.25, kernel)
    o_s = o_s[0].reshape(Hkv, R, G * m, D).transpose(0, 1).float()
    l_s = l_s[0].reshape(Hkv, R, G * m).transpose(0, 1)
    merged, total = T._merge(out.float(), lse, o_s, l_s)
    k_all = torch.cat([ks[None].expand(R, -1, -1, -1), k], 2)
    v_all = torch.cat([vs[None].expand(R, -1, -1, -1), v], 2)
    bias_all = torch.cat([torch.zeros(R, 1, G * m, L_shared, device=device), bias], -1)
    want, want_lse = _brute(q, k_all, v_all, bias_all, 0.25)
    torch.testing.assert_close(merged.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(total.double(), want_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_part_in_half_precision(device, dtype):
    """bf16/fp16 models: the fused masked kernel takes a bias of the queries' dtype; its result
    is within half-precision rounding of float64 brute force on the same (rounded) inputs."""
    torch.manual_seed(7)
    R, G, m, P, Hkv, D = 3, 2, 2, 6, 2, 16
    mask = torch.ones((R, 1, m, P + m), dtype=torch.bool)
    mask[:, :, :, P:] = torch.ones((m, m), dtype=torch.bool).tril()
    mask[1, 0, :, :3] = False
    bias = T.TreeBatch([], None, None, None, P, mask.to(device)).bias(G, dtype)
    assert bias.dtype == dtype
    q = torch.randn(R, Hkv, G * m, D, device=device).to(dtype)
    k = torch.randn(R, Hkv, P + m, D, device=device).to(dtype)
    v = torch.randn(R, Hkv, P + m, D, device=device).to(dtype)
    want, want_lse = _brute(q, k, v, bias, 0.25)
    for kernel in ("flash", "math"):
        out, lse = T._attend(q, k, v, 0.25, kernel, bias)
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=3e-2)

