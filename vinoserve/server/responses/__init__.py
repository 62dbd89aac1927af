"""OpenAI's Responses API over the shared chat path: request.py validates a body and converts it
(input items, tools, tool_choice, text.format, sampling) into a ChatCompletionRequest's fields;
items.py turns input and output items into chat messages; render.py turns the event stream into
Response objects and their streamed events; store.py keeps finished responses for
previous_response_id. The routes are in server/routes/responses.py."""
