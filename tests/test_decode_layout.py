"""The decode step's worked example (genback.llm.hf.decode.step's module docstring), run:
three rows after a 4-token prompt, the layout the step builds, and the static buffers it fills."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import step as decode_step
from genback.llm.hf.decode.step import bucket


def test_the_worked_example_of_the_decode_step(tiny_hf, gpt2_tok, monkeypatch):
    """A fresh pool hands out slots in order: the prompt's KV in slots 1-4, rows a and b one
    token on (slots 5, 6), row c two (7, 8); the step's new tokens go to 9, 10, 11. The layout
    is the docstring's: the prompt as level 0, each row's own slots left-padded with slot 0 and
    its new slot last; the bucket's buffers hold it padded, with the biases built from it."""
    seen = []
    layout = decode_step.DecodeStep.layout

    def spy(self, group, lanes=None):
        out = layout(self, group, lanes)
        seen.append(out[0])
        return out

    monkeypatch.setattr(decode_step.DecodeStep, "layout", spy)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="eager")
    # level 0 kept for the example's 4-token prompt (by default one this short, among 3 rows,
    # is laid out in every row: level 0 would cost more than it saves)
    lm.runner.decode_step.level0_min_tokens = lm.runner.decode_step.level0_min_saved = 0
    prompt = [464, 3139, 286, 4881]
    a, b, c = prompt + [318], prompt + [373], prompt + [468, 262]

    async def run():
        for x in (a, b, c):  # one at a time: their slots in this order
            await lm.next_token_logprobs(x)
        await asyncio.gather(*(lm.next_token_logprobs(x + [13]) for x in (a, b, c)))

    try:
        lm.cache_kv(prompt)
        asyncio.run(run())
        lay = seen[-1]  # the step of the three rows (each row alone was one too)
        assert lay.prefix.tolist() == [1, 2, 3, 4]
        assert lay.table.tolist() == [[0, 5, 9], [0, 6, 10], [7, 8, 11]]
        assert lay.pads.tolist() == [1, 1, 0]
        assert lay.new_slots.tolist() == [9, 10, 11]
        assert lay.positions.tolist() == [5, 5, 6] and lay.ids.tolist() == [13, 13, 13]
        assert bucket(3, 3, 4) == (4, 32, 256)
        buf = lm.runner.decode_step.buffers[(4, 32, 256)]
        Rb, Wb, Pb = buf.key
        table = buf.table.view(Rb, Wb)
        assert table[:3, :3].tolist() == lay.table.tolist() and not table[:, 3:].any()
        assert table[3].tolist() == [0] * Wb  # a padded row: its own new token in slot 0
        assert buf.pads.tolist() == [1, 1, 0, 2] and buf.sizes.tolist() == [3, 4]
        attend = buf.bias1[:, 0, 0] == 0  # [Rb, Wb]: the columns each row reads
        assert attend[:, :4].tolist() == [[False, True, True, False], [False, True, True, False],
                                          [True, True, True, False], [False, False, True, False]]
        assert not attend[:, 3:].any()
        assert (buf.bias0[0, 0, 0] == 0).tolist() == [True] * 4 + [False] * (Pb - 4)
        assert torch.equal(buf.prefix[:4].cpu(), torch.tensor([1, 2, 3, 4]))
        assert np.array_equal(buf.new_slots[:3].cpu().numpy(), lay.new_slots)
    finally:
        lm.close()
