"""Greedy decoding with HF transformers as the reference: plain argmax, EOS not special-cased
(the engine runs with ignore_eos, so EOS is just another token to both)."""
from __future__ import annotations

import torch


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out, tokens = None, []
    with torch.no_grad():
        step = torch.tensor([prompt])
        for _ in range(n):
            out = hf(step, past_key_values=out.past_key_values if out else None, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens
