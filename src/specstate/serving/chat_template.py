"""A checkpoint's chat template: messages rendered to the prompt text, as Hugging Face does.

Owner of how ``POST /v1/chat/completions`` turns a conversation into a prompt. `load_chat_template`
finds the template of a checkpoint directory the way ``transformers`` does (a
``chat_template.jinja`` file beside the weights, else ``tokenizer_config.json``'s
``chat_template``: a string, or a list of named templates of which ``default`` is used), or takes
the ``--chat-template FILE`` given instead. `ChatTemplate.render` renders it in Jinja2's
``ImmutableSandboxedEnvironment`` with the environment ``transformers``' ``apply_chat_template``
builds (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``) and the same variables:
``messages``, ``tools``, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` from ``tokenizer_config.json``).

The embedded byte-level model ships a ``chat_template.jinja`` of its own (plain ``role: text``
lines), so chat works on a fresh install.

Needs ``jinja2`` (the ``serve`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from specstate.core.errors import InvalidConfig

__all__ = ["ChatTemplate", "TemplateRenderError", "load_chat_template"]

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The special tokens a template sees by name (``tokenizer_config.json``'s)."""


class TemplateRenderError(ValueError):
    """The template failed on these messages (``raise_exception``, or a Jinja2 error)."""


@attrs.frozen(kw_only=True)
class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Attributes:
        source: the Jinja2 text.
        origin: where it came from (a path), for messages.
        special_tokens: ``bos_token`` etc. by name, as text.
    """

    source: str
    origin: str
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)
    _compiled: Any = attrs.field(init=False, default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _environment().from_string(self.source))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of ``messages`` (and ``tools``, for a template that shows them).

        Raises:
            TemplateRenderError: the template refused the messages or failed on them.
        """
        try:
            text: str = self._compiled.render(
                messages=list(messages),
                tools=None if tools is None else list(tools),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except Exception as exc:  # whatever the template does wrong is this request's 400
            raise TemplateRenderError(f"{type(exc).__name__}: {exc}") from None
        return text


def _environment() -> Any:
    """The sandboxed environment ``transformers`` renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _token_text(value: object) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_config(model: Path) -> dict[str, Any]:
    path = model / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read it ({exc})") from None
    return config if isinstance(config, dict) else {}


def _named_default(value: object, path: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise InvalidConfig(f"{path}: chat_template must be a string or a list with a 'default' one")


def load_chat_template(model: Path | None, override: Path | None = None) -> ChatTemplate | None:
    """The chat template of the checkpoint at ``model`` (module docstring), ``override``'s text
    when given; None when there is none.

    Raises:
        InvalidConfig: a template that cannot be read or does not compile.
    """
    config = {} if model is None else _read_config(model)
    specials = {
        name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None
    }
    if override is not None:
        origin = override
        source = _read_text(override)
    elif model is not None and (model / "chat_template.jinja").is_file():
        origin = model / "chat_template.jinja"
        source = _read_text(origin)
    elif "chat_template" in config:
        origin = model / "tokenizer_config.json" if model is not None else Path("?")
        source = _named_default(config["chat_template"], origin)
    else:
        return None
    try:
        return ChatTemplate(source=source, origin=str(origin), special_tokens=specials)
    except Exception as exc:  # jinja2.TemplateSyntaxError and the like
        raise InvalidConfig(f"{origin}: the chat template does not compile ({exc})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read the chat template ({exc})") from None
