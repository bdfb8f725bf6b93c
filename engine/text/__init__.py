"""The text layer: everything between a model's text interface and its token ids.

Used alike by the server (frontend/) and the offline API (engine/llm.py); it imports nothing
of the frontend. Modules: `recipe` (chats -> ids, injection-safe) built on `messages`
(validation), `symbolic` (user-text placeholders) and `sandbox` (the budgeted Jinja
environment); `tokenizer` (loading, control tokens, the text-only encoder); `detokenizer`,
`stop` and `output` (token ids -> text of one output stream); `tool_parser` and
`tool_formats` (tool calls in model output); `reasoning` (the thinking block apart from the
answer).
"""
