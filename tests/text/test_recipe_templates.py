"""Template features render as in transformers; hostile templates fail fast with RecipeError."""
import time

import pytest

from duplex.engine.text.messages import Chat
from duplex.engine.text.recipe import Recipe, RecipeError, RenderLimits
from recipe_factories import (WEATHER_TOOL, assistant, reference_ids, system, tool_call, user)

CHAT = [system("  Be brief.  "), user("  Hello <b>there</b>, wörld 🙂  "),
        assistant("<think>\nhmm\n</think>\n\nThe answer.", reasoning_content="Hmm, Zürich.",
                  tool_calls=[
            tool_call("get_weather", {"city": "Zürich", "n": 3, "ok": True, "x": None})]),
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        user("Thanks, 你好!")]

# Each template transforms user text in a way the symbolic render follows exactly.
TRACED_TEMPLATES = {
    "llama3 trim": "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n\\n'"
                   " + m.content | trim + '<|im_end|>' }}{% endfor %}",
    "think split": "{% for m in messages %}{% set c = m.content %}{% if '</think>' in c %}"
                   "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
                   "<|im_start|>{{ m.role }}\n{{ c }}<|im_end|>\n{% endfor %}",
    "tojson variants": "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|"
                       "{{ tools | tojson(sort_keys=True) }}|{{ tools | tojson(ensure_ascii=True) }}|"
                       "{{ messages | tojson(separators=(',', ':')) }}",
    "string methods": "{% for m in messages %}{{ m.content.upper() }}|{{ m.content.lower() }}|"
                      "{{ m.content.title() }}|{{ m.content.replace('o', '0') }}|"
                      "{{ m.content[:5] }}|{{ m.content[::-1] }}|{{ m.content | length }}|"
                      "{{ 'o' in m.content }}|{{ m.content.startswith('  ') }}|"
                      "{{ m.content | list | first | default('') }}|{{ m.content | reverse }}|"
                      "{{ m.content.center(40, '*') }}|{{ m.content.split() | join('_') }}|"
                      "{{ m.content.splitlines() | length }}|{{ '%s!' % m.content }}|"
                      "{{ m.content | e }}|{{ m.content | truncate(9) }}|{{ m.content | capitalize }}|"
                      "{{ '{}?'.format(m.content) }}|{{ m.content == '5' }}{% endfor %}",
    "loops": "{% for m in messages %}{% if loop.index > 4 %}{% break %}{% endif %}"
             "{% if m.role == 'system' %}{% continue %}{% endif %}"
             "{{ loop.index }}/{{ loop.length }}/{{ loop.revindex }}/{{ loop.last }}:"
             "{{ m.content }}{% endfor %}",
    "namespace": "{% set ns = namespace(found=false, text='') %}{% for m in messages %}"
                 "{% if m.role == 'tool' %}{% set ns.found = true %}"
                 "{% set ns.text = ns.text ~ m.content %}{% endif %}{% endfor %}"
                 "{{ ns.found }}{{ ns.text }}",
    "filters": "{{ messages | map(attribute='role') | join(',') }}|"
               "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content')"
               " | join('<|im_end|>') }}|{{ (messages | map(attribute='role') | unique"
               " | list) }}|{{ messages[2].tool_calls[0].function.arguments | dictsort }}",
    "arguments": "{% for c in messages[2].tool_calls %}{% for k, v in c.function.arguments"
                 " | items %}{{ k + '=' }}{{ v }};{% endfor %}{{ c.function.arguments.n + 1 }}"
                 "{{ c.function.arguments.city is string }}{% endfor %}",
    "tests": "{% for m in messages %}{{ m.name is defined }}{{ m.content is string }}"
             "{{ m.content | default('none') }}{{ m.content | wordcount if false else '' }}"
             "{% endfor %}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                      "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
                      "{% endif %}{% endfor %}",
    "reasoning": "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|"
                 "{{ m | tojson }}{% endfor %}",
    "tools loop": "{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}"
                  "{% for p, spec in t.function.parameters.properties.items() %} {{ p }}"
                  "({{ spec.type }}){% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TRACED_TEMPLATES))
def test_traced_templates_match_transformers(default_recipe, name):
    template = TRACED_TEMPLATES[name]
    expected = reference_ids(default_recipe.tokenizer, CHAT, tools=[WEATHER_TOOL],
                             template=template)
    ids = default_recipe.encode_chat(Chat.from_dicts(CHAT, [WEATHER_TOOL]), template=template)
    assert ids == expected


def test_strftime_now(default_recipe):
    text = default_recipe.render_chat(Chat.from_dicts([user("hi")]),
                                      template="{{ strftime_now('%Y-%m-%d') }}").text
    assert text == time.strftime("%Y-%m-%d")


def test_raise_exception_becomes_recipe_error(default_recipe):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    with pytest.raises(RecipeError, match="System first!"):
        default_recipe.encode_chat(Chat.from_dicts([user("hi")]), template=template)


@pytest.mark.parametrize("template, content", [
    ("{{ messages[0].content | int }}", "5"),
    ("{{ messages[0].content | urlencode }}", "x y"),
    ("{{ (messages[0].content ~ '') | trim }}", " x "),
    ("{{ '%5s' % messages[0].content }}", "x"),
])
def test_untraceable_transforms_are_refused(default_recipe, template, content):
    with pytest.raises(RecipeError, match="cannot trace"):
        default_recipe.encode_chat(Chat.from_dicts([user(content)]), template=template)


def test_model_without_template(default_tokenizer):
    recipe = Recipe(default_tokenizer)
    recipe.template = None
    with pytest.raises(RecipeError, match="no chat template"):
        recipe.encode_chat(Chat.from_dicts([user("hi")]))
    assert recipe.encode_chat(Chat.from_dicts([user("hi")]),
                              template="{{ messages[0].content }}") == [6004]


HOSTILE_TEMPLATES = {
    "dunder class": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "dunder in if": "{% if messages.__class__ %}x{% endif %}",
    "globals via cycler": "{{ cycler.__init__.__globals__ }}",
    "globals via raise_exception": "{{ raise_exception.__globals__ }}",
    "template internals": "{{ self._TemplateReference__context }}",
    "namespace dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "mutating a list": "{% set x = [] %}{{ x.append(1) }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}",
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                "{{ '' }}{% endfor %}{% endfor %}",
    "loop over messages forever": "{% for m in messages recursive %}{{ loop(messages) }}"
                                  "{% endfor %}",
    "macro bomb": "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}",
    "string times": "{{ 'a' * 100000000 }}",
    "string times twice": "{{ 'ab' * 99999 * 99999 }}",
    "list times": "{{ (range(100000) | list) * 100000 }}",
    "huge power": "{{ 9 ** 99999 }}",
    "power tower": "{{ (9 ** 999) ** 999 }}",
    "doubling with tilde": "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling with plus": "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}"
                          "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "huge indent": "{{ ('x\\n' * 100000) | indent(100000) }}",
    "huge replace": "{{ 'a'.ljust(99999).replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb'"
                    " * 10) }}",
    "huge format width": "{{ '{:>99999999}'.format(1) }}",
    "nested format width": "{{ '{:>{w}}'.format(1, w=99999999) }}",
    "huge percent width": "{{ '%99999999s' % 1 }}",
    "star percent width": "{{ '%*s' % (99999999, 1) }}",
    "huge join": "{{ (range(100000) | join) * 100 }}",
    "join with a huge separator": "{{ range(100000) | join('x' * 100000) }}",
    "join a generator with a huge separator": "{{ range(100000) | map('string') | join('x' * 100000) }}",
    "method join with a huge separator": "{{ ('x' * 100000).join(range(100000) | map('string')) }}",
    "doubling in a block set": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                               "{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}{% endfor %}",
    "doubling through a macro": "{% macro twice(x) %}{{ x }}{{ x }}{% endmacro %}"
                                "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                                "{% set ns.s = twice(ns.s) %}{% endfor %}",
    "doubling with format": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                            "{% set ns.s = '{}{}'.format(ns.s, ns.s) %}{% endfor %}",
    "shared list printed": "{% set ns = namespace(s=[1]) %}{% for i in range(60) %}"
                           "{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s }}",
    "shared tuple hashed": "{% set ns = namespace(s=(1,)) %}{% for i in range(60) %}"
                           "{% set ns.s = (ns.s, ns.s) %}{% endfor %}{{ [ns.s] | unique | list }}",
    "shared dict dumped": "{% set ns = namespace(s={}) %}{% for i in range(60) %}"
                          "{% set ns.s = dict(a=ns.s, b=ns.s) %}{% endfor %}{{ ns.s | tojson }}",
    "nested namespaces": "{% set ns = namespace(s=1) %}{% for i in range(60) %}"
                         "{% set ns = namespace(a=ns, b=ns) %}{% endfor %}{{ ns }}",
    "hoarding copies": "{% set ns = namespace(keep=[]) %}{% for i in range(100000) %}"
                       "{% set ns.keep = ns.keep + [('x' * 10000000).upper()] %}{% endfor %}",
    "hoarding slices": "{% set s = 'x' * 10000000 %}{% set ns = namespace(keep=[]) %}"
                       "{% for i in range(100000) %}{% set ns.keep = ns.keep + [s[i:]] %}{% endfor %}",
    "list of a long string": "{{ ('x' * 10000000) | list | length }}",
    "huge tojson indent": "{{ messages | tojson(indent=1000000) }}",
    "big range": "{{ range(10 ** 9) | list }}",
    "lipsum": "{{ lipsum(n=100000) }}",
    "include": "{% include 'secrets.txt' %}",
    "extends": "{% extends '/etc/passwd' %}",
    "import": "{% import 'os' as os %}",
    "syntax error": "{% for %}",
    "deep nesting": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "too long": "x" * 300_000,
    "undefined call": "{{ nothing() }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_fail_fast(default_recipe, name):
    started = time.monotonic()
    with pytest.raises(RecipeError):
        default_recipe.encode_chat(Chat.from_dicts([user("hi")]), template=HOSTILE_TEMPLATES[name])
    assert time.monotonic() - started < default_recipe.limits.seconds * 2 + 0.5


def test_time_limit(default_tokenizer):
    recipe = Recipe(default_tokenizer, limits=RenderLimits(seconds=0.05, steps=10 ** 9))
    started = time.monotonic()
    with pytest.raises(RecipeError, match="longer than"):
        recipe.encode_chat(Chat.from_dicts([user("hi")]),
                           template=HOSTILE_TEMPLATES["nested loops"])
    assert time.monotonic() - started < 1.0


def test_output_limit(default_tokenizer):
    recipe = Recipe(default_tokenizer, limits=RenderLimits(chars=1000))
    with pytest.raises(RecipeError, match="over 1000 chars"):
        recipe.encode_chat(Chat.from_dicts([user("hi")]),
                           template="{% for i in range(100) %}{{ 'x' * 20 }}{% endfor %}")


def test_hostile_template_leaves_recipe_usable(default_recipe):
    with pytest.raises(RecipeError):
        default_recipe.encode_chat(Chat.from_dicts([user("hi")]),
                                   template=HOSTILE_TEMPLATES["nested loops"])
    assert default_recipe.encode_chat(Chat.from_dicts([user("hi")])) == reference_ids(
        default_recipe.tokenizer, [user("hi")])


def test_render_limits_validate():
    with pytest.raises(ValueError):
        RenderLimits(seconds=0)
