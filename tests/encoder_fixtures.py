"""Tiny random BERT-family models in Hugging Face / sentence-transformers layout, as the
references for the encoder graph (seconds to make, no download)."""
from __future__ import annotations

from pathlib import Path

WORDS = ("the a of to and in is it that was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "paris france capital city river cat dog sat mat").split()


def wordpiece_tokenizer(path: Path, lowercase: bool = True, roberta_pairs: bool = False):
    """A BERT WordPiece tokenizer over a small vocabulary, saved as tokenizer.json (+ the
    transformers files) under `path`; returns the transformers tokenizer. Pairs as BERT's
    ([CLS] a [SEP] b [SEP], b of token type 1) or RoBERTa's ([CLS] a [SEP] [SEP] b [SEP], type 0)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?'0123456789")
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + letters + [f"##{c}" for c in letters] + list(WORDS)))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] [SEP] $B [SEP]" if roberta_pairs else "[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    fast.save_pretrained(path)
    return fast


def tiny_config(model_type: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    base = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, max_position_embeddings=80, type_vocab_size=2, pad_token_id=0,
                initializer_range=0.2)  # wide enough that random texts score apart
    if model_type == "xlm-roberta":
        base.update(pad_token_id=1, max_position_embeddings=82, type_vocab_size=1)
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def save_embedder(path: Path, model_type: str = "bert", pooling: str = "mean", normalize: bool = True,
                  max_seq_length: int = 64, seed: int = 0, **overrides) -> Path:
    """A sentence-transformers directory: random encoder, Pooling(pooling), Normalize if asked."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModel

    torch.manual_seed(seed)
    hf = path / "hf"
    tokenizer = wordpiece_tokenizer(hf)
    AutoModel.from_config(tiny_config(model_type, len(tokenizer), **overrides)).save_pretrained(hf)
    transformer = models.Transformer(str(hf), max_seq_length=max_seq_length)
    modules = [transformer, models.Pooling(64, pooling_mode=pooling)] + ([models.Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(path / "st"))
    return path / "st"


def save_cross_encoder(path: Path, model_type: str = "bert", seed: int = 0, num_labels: int = 1) -> Path:
    """A transformers *ForSequenceClassification directory with one logit (a reranker)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    tokenizer = wordpiece_tokenizer(path, roberta_pairs=model_type != "bert")
    config = tiny_config(model_type, len(tokenizer), num_labels=num_labels)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path
