"""genlm-bytes 0.2.0 client program: byte-level log-probabilities with ``ByteLLM``.

genlm-control's ``ByteLLM`` potential (over genlm-bytes' ``ByteBeamState`` beam and its
``AsyncTokenByteTrie``) is built with ``ByteLLM.from_name(path, beam_params, backend="hf")``, which
calls ``genlm.backend.load_model_by_name``. After a short prompt it computes the byte-level
``prefix`` log-probability of a reply, the ``complete`` log-probability (reply then end of
sequence), and the next-byte distribution after the reply without its final byte.

Prints ``RESULT {...}`` with those log-probabilities and the top next bytes.
``--scale`` has no effect here (the work is set by the prompt and reply lengths).
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

PROMPT = "The capital of France is"
REPLY = b" Paris."
BEAM_K = 4


def main():
    args = _common.setup(__doc__.splitlines()[0])
    with _common.phase(args, "import"):
        import numpy as np
        from genlm.bytes import BeamParams
        from genlm.control import ByteLLM
    with _common.phase(args, "load"):
        params = BeamParams(K=BEAM_K, eos_byte_strings=[b"<|im_end|>"], heal=True)
        byte_llm = ByteLLM.from_name(_common.model_path(), params, backend="hf")
        byte_llm.set_prompt_from_str(PROMPT)

    def as_bytes(data: bytes) -> list[bytes]:
        return [bytes([b]) for b in data]

    async def run():
        try:
            prefix = await byte_llm.prefix(as_bytes(REPLY))
            complete = await byte_llm.complete(as_bytes(REPLY))
            first_word = as_bytes(REPLY[:-1])
            first = await byte_llm.prefix(first_word)
            nxt = await byte_llm.logw_next(first_word)
        finally:
            await byte_llm.cleanup()
        w = np.asarray(nxt.weights, dtype=float)
        top = np.argsort(-w, kind="stable")[:5]
        tokens = list(nxt.decode)
        return {
            "prefix_logp": float(prefix),
            "complete_logp": float(complete),
            "first_word_logp": float(first),
            "next_top": [[repr(tokens[i]), float(w[i])] for i in top],
        }

    _common.seed_all(0)
    with _common.phase(args, "bytellm"):
        result = asyncio.run(run())
    _common.emit(args, {"program": "bytes_bytellm", "reply": REPLY.decode(), "beam_K": BEAM_K, **result})


if __name__ == "__main__":
    main()
