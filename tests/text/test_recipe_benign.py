"""Benign chats tokenize exactly as transformers' apply_chat_template does."""
import pytest

from duplex.engine.text.messages import Chat

from recipe_factories import BENIGN_CHATS, reference_ids, tool_chats


@pytest.mark.parametrize("name", sorted(BENIGN_CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_matches_transformers(default_recipe, name, add_generation_prompt):
    messages = BENIGN_CHATS[name]
    expected = reference_ids(default_recipe.tokenizer, messages,
                             add_generation_prompt=add_generation_prompt)
    chat = Chat.from_dicts(messages)
    assert default_recipe.encode_chat(chat, add_generation_prompt=add_generation_prompt) \
        == expected


@pytest.mark.parametrize("name", sorted(BENIGN_CHATS))
def test_tools_template_matches_transformers_without_tools(tools_recipe, name):
    messages = BENIGN_CHATS[name]
    assert tools_recipe.encode_chat(Chat.from_dicts(messages)) == reference_ids(
        tools_recipe.tokenizer, messages)


@pytest.mark.parametrize("name", sorted(tool_chats()))
def test_tools_template_matches_transformers(tools_recipe, name):
    messages, tools = tool_chats()[name]
    expected = reference_ids(tools_recipe.tokenizer, messages, tools=tools)
    assert tools_recipe.encode_chat(Chat.from_dicts(messages, tools)) == expected


def test_tools_template_writes_its_tool_call_tokens(tools_recipe):
    messages, tools = tool_chats()["call and result"]
    ids = tools_recipe.encode_chat(Chat.from_dicts(messages, tools))
    tool_call_id = tools_recipe.control_tokens["<tool_call>"]
    # two in the system prompt's instructions, one for the assistant's call
    assert ids.count(tool_call_id) == 3


@pytest.mark.parametrize("name", sorted(BENIGN_CHATS))
def test_sectioned_encoding_equals_transformers_on_benign_text(default_recipe, name):
    """The path hostile chats take (cut at the template's control tokens, text between them
    encoded with control tokens off) gives transformers' ids on benign text: pieces are cut
    only at control tokens, where transformers cuts too, never at user/template boundaries."""
    messages = BENIGN_CHATS[name]
    rendered = default_recipe.render_chat(Chat.from_dicts(messages))
    assert default_recipe._encode_sections(rendered) == reference_ids(
        default_recipe.tokenizer, messages)


@pytest.mark.parametrize("name", sorted(tool_chats()))
def test_sectioned_encoding_equals_transformers_with_tools(tools_recipe, name):
    messages, tools = tool_chats()[name]
    rendered = tools_recipe.render_chat(Chat.from_dicts(messages, tools))
    assert tools_recipe._encode_sections(rendered) == reference_ids(
        tools_recipe.tokenizer, messages, tools=tools)


def test_rendered_text_equals_transformers_text(default_recipe):
    messages = BENIGN_CHATS["multi turn"]
    expected = default_recipe.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert default_recipe.render_chat(Chat.from_dicts(messages)).text == expected


def test_count_chat_tokens(default_recipe):
    messages = BENIGN_CHATS["multi turn"]
    chat = Chat.from_dicts(messages)
    assert default_recipe.count_chat_tokens(chat) == len(default_recipe.encode_chat(chat))


def test_developer_role_is_system(default_recipe):
    as_developer = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}]
    assert default_recipe.encode_chat(Chat.from_dicts(as_developer)) == \
        default_recipe.encode_chat(Chat.from_dicts(as_system))


def test_assistant_tool_call_without_content(tools_recipe):
    messages, tools = tool_chats()["call and result"]
    assert messages[1]["content"] is None
    assert tools_recipe.encode_chat(Chat.from_dicts(messages, tools)) == reference_ids(
        tools_recipe.tokenizer, messages, tools=tools)
