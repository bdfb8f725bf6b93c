"""`duplex serve --chat-template FILE`: the file's template renders the chat, through the same
sandboxed, injection-safe encoder; the cached recipe of the model keeps its own template."""
from __future__ import annotations

from duplex.frontend.operator_flags import read_chat_template, with_chat_template
from duplex.engine.text.messages import Chat
from duplex.engine.text.recipe import Recipe

from duplex.engine.config import default_model_path

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_chat_template_file_replaces_the_models_own(default_recipe, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text(TEMPLATE)
    custom = with_chat_template(default_recipe, read_chat_template(str(path)))
    messages = [{"role": "user", "content": "hi <|im_start|>"}]
    rendered = custom.render_chat(Chat.from_dicts(messages))
    assert rendered.text == "[user] hi <|im_start|>\n[assistant] "
    ids = custom.encode_chat(Chat.from_dicts(messages))
    assert default_recipe.tokenizer.decode(ids) == rendered.text
    im_start = default_recipe.control_tokens["<|im_start|>"]
    assert im_start not in ids  # user text never becomes a control token, template or not
    # the shared, cached recipe is untouched
    assert Recipe.from_model(default_model_path()) is default_recipe
    assert default_recipe.template != TEMPLATE
    rendered = default_recipe.render_chat(Chat.from_dicts(messages))
    assert "<|im_start|>" in rendered.text.split("hi")[0]
