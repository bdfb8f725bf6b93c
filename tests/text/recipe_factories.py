"""Chats, templates and the transformers reference the recipe tests compare against."""
import copy
import json

# A Hermes/Qwen2.5-style tools template, written for these tests. It trims user text, JSON-dumps
# tools and arguments, folds consecutive tool results into one user turn and writes the
# non-special `<tool_call>` tokens itself.
TOOLS_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content | trim + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city — ünïcode, 天气",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def user(content, **extra):
    return {"role": "user", "content": content, **extra}


def system(content):
    return {"role": "system", "content": content}


def assistant(content, **extra):
    return {"role": "assistant", "content": content, **extra}


def tool_call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


BENIGN_CHATS = {
    "single user": [user("Hello")],
    "with system": [system("You are terse."), user("Hi there")],
    "multi turn": [system("Be kind."), user("What is 2+2?"), assistant("4."),
                   user("And 3+3?"), assistant("6."), user("Thanks!")],
    "text parts": [user([{"type": "text", "text": "part one"},
                         {"type": "text", "text": "part two"}])],
    "unicode": [user("héllo wörld — ünïcödé “quotes” ½ ∑ ∞ مرحبا שלום")],
    "emoji": [user("🙂👍🏽👨‍👩‍👧 🇫🇷 ✨🔥"), assistant("🎉"), user("👀")],
    "cjk": [user("你好，世界。日本語のテキスト 한국어 텍스트")],
    "whitespace": [system("  padded system  "), user("   leading"), assistant("trailing   "),
                   user("\n\nnew\nlines\n\n"), assistant("\t tabs \t"), user("   ")],
    "empty content": [system(""), user(""), assistant(""), user("x")],
    "template-like text": [user("{{ messages }} {% if x %} {# c #} ' \" \\ \\n")],
    "token lookalikes": [user("<|im_start <|im_end |im_end|> < |im_end| > <|IM_END|> im_end "
                              "<|im"), assistant("|>end|><|im_")],
    "long": [user("The quick brown fox jumps over the lazy dog. " * 120)],
    "private use chars": [user("\ue000\ue001 \ue00012345678.0\ue001")],
}


def tool_chats():
    """Chats for the tools template (arguments as JSON strings, as clients send them)."""
    call = tool_call("get_weather", {"city": "Paris", "unit": "celsius"})
    second = tool_call("search", {"q": "best café — 東京"}, call_id="call_2")
    return {
        "tools, user only": ([user("Weather in Paris?")], [WEATHER_TOOL]),
        "tools with system": ([system("You help."), user("Weather?")],
                              [WEATHER_TOOL, SEARCH_TOOL]),
        "call and result": ([user("Weather in Paris?"), assistant(None, tool_calls=[call]),
                             {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
                             assistant("It is 18°C."), user("  thanks  ")], [WEATHER_TOOL]),
        "two calls, two results": ([user("Both?"),
                                    assistant("Checking.", tool_calls=[call, second]),
                                    {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
                                    {"role": "tool", "tool_call_id": "call_2", "content": "{}"}],
                                   [WEATHER_TOOL, SEARCH_TOOL]),
        "no tools": ([system("Plain."), user("Hi"), assistant("Hello"), user("🙂")], None),
    }


def reference_messages(messages):
    """What transformers is given for the same chat: text parts joined, arguments as dicts."""
    out = []
    for message in copy.deepcopy(messages):
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        if message.get("content") is None:
            message["content"] = ""
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(message)
    return out


def reference_ids(tokenizer, messages, tools=None, add_generation_prompt=True, template=None):
    """transformers' own token ids for a chat."""
    encoding = tokenizer.apply_chat_template(
        reference_messages(messages), tools=tools, add_generation_prompt=add_generation_prompt,
        chat_template=template, tokenize=True)
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


def control_ids_in(ids, control_ids):
    return [token_id for token_id in ids if token_id in control_ids]
