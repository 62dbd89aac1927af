"""Anthropic's Messages API over the shared chat path: request.py validates a body and converts
it (system, content blocks, tools, tool_choice, thinking, stop_sequences) into a
ChatCompletionRequest's fields; render.py turns the event stream into a Message and its streamed
events; errors.py is Anthropic's error body. The routes are in server/routes/anthropic.py."""
