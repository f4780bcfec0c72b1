"""Chat templates rendered as HF transformers renders them (jinja2, imported only by
`Tokenizer.apply_chat_template`, so plain generation never pays for it)."""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from jaxdec.errors import JaxdecError

# Gemma 3's chat format, for Gemma 3 GGUF files, which carry no template. Turns are
# `<start_of_turn>ROLE\n` + the trimmed text + `<end_of_turn>\n`, ROLE "user" or "model" (the
# assistant), alternating from a user turn; a system message is no turn of its own but opens
# the first one (its text, then a blank line); the generation prompt is `<start_of_turn>model\n`.
# Content is a string or a list of parts (text, or an image marker).
GEMMA3 = r"""{{- bos_token -}}
{%- macro text(content) -%}
    {%- if content is string -%}{{ content | trim }}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}{{ part['text'] | trim }}
            {%- elif part['type'] == 'image' -%}<start_of_image>
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}{{ raise_exception("Invalid content type") }}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
{%- if has_system -%}
    {%- set system = messages[0]['content'] -%}
    {%- set opening = (system if system is string else system[0]['text']) + '\n\n' -%}
{%- else -%}
    {%- set opening = '' -%}
{%- endif -%}
{%- for m in (messages[1:] if has_system else messages) -%}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") -}}
    {%- endif -%}
    {{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' -}}
    {{- opening if loop.first else '' -}}{{- text(m['content']) -}}{{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` assistant-mask marker: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Like HF's `tojson`: plain `json.dumps`, no HTML escaping, non-ASCII kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """A chat template compiled the way HF does: sandboxed, trim_blocks, lstrip_blocks."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(source: str, /, **context: Any) -> str:
    """The template `source` rendered with `context`; a template error is a JaxdecError."""
    try:
        return _compile(source).render(**context)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxdecError(f"chat template failed: {first}") from None
