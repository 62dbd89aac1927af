"""vinoserve: an OpenAI-compatible LLM server on OpenVINO PagedAttention."""
