"""BERT-family encoders (embedders, cross-encoder rerankers): graphs built from safetensors, run on
ragged batches outside the paged engine (no KV cache, no steps)."""
