"""OpenAI's Responses API over the shared chat path: schema.py and request.py validate a body
(items, tools, tool_choice, text.format, the fields refused) and convert it into a
ChatCompletionRequest's fields; items.py turns input and output items into chat messages;
render.py builds the Response and its streamed events from the event stream; store.py keeps
finished responses for previous_response_id. The routes are in server/routes/responses.py."""
