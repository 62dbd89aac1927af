"""A tiny model whose weights make it write a given script: its next token depends only on the
current one, through a table of ranked successors, so greedy decoding follows the table and a
grammar or logit_bias that forbids the first choice gets the second.

Attention and MLP outputs are zeroed, so the residual stream is the token's embedding; the
scripted tokens have orthogonal embeddings (RMS 1), and the LM head maps each to its successors'
scores exactly. Everything else about the model (the OpenVINO graph, PagedAttention, the
tokenizer built from the GGUF, the sampler, llguidance) is the real path.
"""
from __future__ import annotations

from pathlib import Path

import torch

from gguf_fixtures import BYTE_TOKENS, MERGES, Vocab, tiny_hf_model, write_gguf

CONTROL, USER_DEFINED = 3, 4


def scripted_vocab(added: list[str], control: list[str], eos: str, chat_template: str) -> Vocab:
    """Byte tokens and two merges, then `added` as user-defined tokens (matched whole, decoded as
    their text), then `control` tokens (special: never text)."""
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = BYTE_TOKENS + merged + added + control
    types = [1] * (len(BYTE_TOKENS) + len(merged)) + [USER_DEFINED] * len(added) + [CONTROL] * len(control)
    return Vocab(tokens, types, tokens.index(eos), chat_template)


def scripted_gguf(vocab: Vocab, successors: dict[str, list[str]], path: Path, context: int = 2048) -> Path:
    """`successors[token]`: the tokens that may follow `token`, most likely first (3 at most, the
    first at 20 and each next 4 lower, every other token at 0: at temperature 1, which agent
    clients send, a step leaves the script with probability ~300 e^-20; at 12 it was ~0.2%, and
    a Claude Code run failed on it once in some twenty). Names as in `vocab.tokens`; a byte is in its
    GPT-2 form ("\\n" is "Ċ"). `context`: the model's context length (byte-level prompts with
    tools run to ~1k tokens; an agent client's to tens of thousands)."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    scripted = sorted({ids[t] for t in successors} | {ids[s] for ss in successors.values() for s in ss})
    hidden = 64
    assert len(scripted) <= hidden and max(map(len, successors.values())) <= 3
    model = tiny_hf_model("llama", layers=1, vocab=vocab)
    model.config.max_position_embeddings = context
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()  # the layer adds nothing: the residual stream is the embedding
            elif "norm" in name:
                p.fill_(1.0)
        basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))[0]
        emb = model.model.embed_tokens.weight
        for k, t in enumerate(scripted):
            emb[t] = basis[k] * hidden ** 0.5  # RMS 1: the final norm leaves it as it is
        head = torch.zeros_like(model.lm_head.weight)
        for token, following in successors.items():
            for rank, s in enumerate(following):
                head[ids[s]] += (20.0 - 4.0 * rank) * emb[ids[token]] / hidden
        model.lm_head.weight.copy_(head.half().float())
        emb.copy_(emb.half().float())
    return write_gguf(model, path, vocab=vocab)
