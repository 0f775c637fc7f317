"""Chat templates as `transformers` renders them, and `specstate serve --model DIR` chatting.

A tiny byte-level BPE checkpoint gets a ``tokenizer_config.json`` with a chat template that uses
what templates in the wild use (special tokens by name, ``tojson`` on tools, loop controls,
``raise_exception``, ``add_generation_prompt``). `load_chat_template` renders it exactly as
``AutoTokenizer.apply_chat_template`` does, and the server, built as the command builds it and
asked with the real ``openai`` client, answers with `Engine`'s greedy tokens on the ids
``apply_chat_template`` gives, streaming and not.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
from serving_harness import bounded
from subword_tokenizers import subword_checkpoint
from transformers import AutoTokenizer

from specstate import Engine, EngineConfig, SamplingParams
from specstate.core.errors import InvalidConfig
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.serving.background import BackgroundServer
from specstate.serving.chat_template import TemplateRenderError, load_chat_template
from specstate.serving.openai_server import create_app
from specstate.tools import serve
from specstate.tools.generate.workers import checkpoint_limits

TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}"
    "{% endif %}"
    "{% if m.role == 'tool' %}<tool id={{ m.tool_call_id }}>{{ m.content }}</tool>\n"
    "{% continue %}{% endif %}"
    "<|{{ m.role }}|>\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}"
    "<call>{{ call.function.name }} {{ call.function.arguments }}</call>"
    "{% endfor %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}\n<|assistant|>\n{% endif %}"
)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You add numbers. Café, 東京."},
    {"role": "user", "content": "def add(a, b):"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers — à la café",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def chat(client: Any, **kwargs: Any) -> Any:
    """``client.chat.completions.create`` untyped (tests send dict messages and extensions)."""
    return client.chat.completions.create(**kwargs)


def _with_template(directory: Path) -> None:
    """The checkpoint's tokenizer_config.json: a fast tokenizer, its specials, the template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def _hf_ids(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """``apply_chat_template``'s token ids (a plain list, whatever the transformers version)."""
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return [int(t) for t in ids]


def test_the_template_renders_as_transformers_apply_chat_template(tmp_path: Path) -> None:
    """Text and ids equal ``apply_chat_template``'s, with and without tools and the generation
    prompt; a ``raise_exception`` in the template is a `TemplateRenderError`."""
    subword_checkpoint(tmp_path)
    _with_template(tmp_path)
    template = load_chat_template(tmp_path)
    assert template is not None
    hf: Any = AutoTokenizer.from_pretrained(tmp_path)
    for tools in (None, TOOLS):
        for generation in (True, False):
            ours = template.render(MESSAGES, tools=tools, add_generation_prompt=generation)
            theirs = hf.apply_chat_template(
                MESSAGES, tools=tools, add_generation_prompt=generation, tokenize=False
            )
            assert ours == theirs
            assert ours.startswith("<s>") and "</s>" in ours
            ids = _hf_ids(hf, MESSAGES, tools=tools, add_generation_prompt=generation)
            assert hf.encode(ours, add_special_tokens=False) == ids
    with pytest.raises(TemplateRenderError, match="the system message must come first"):
        template.render([*MESSAGES, {"role": "system", "content": "late"}])


def test_a_template_file_overrides_and_the_sandbox_holds(tmp_path: Path) -> None:
    """``--chat-template FILE`` replaces the checkpoint's; ``chat_template.jinja`` is found as
    transformers finds it; a template that reaches for Python internals fails to render; a
    template that does not compile is an `InvalidConfig` naming the file."""
    subword_checkpoint(tmp_path)
    _with_template(tmp_path)
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}", encoding="utf-8")
    mine = load_chat_template(tmp_path, override)
    assert (
        mine is not None
        and mine.render(MESSAGES[:2]) == "[You add numbers. Café, 東京.][def add(a, b):]"
    )
    (tmp_path / "chat_template.jinja").write_text("jinja file {{ eos_token }}", encoding="utf-8")
    found = load_chat_template(tmp_path)
    assert found is not None and found.render(MESSAGES) == "jinja file </s>"
    escape = tmp_path / "escape.jinja"
    escape.write_text("{{ messages.__class__.__mro__ }}", encoding="utf-8")
    sandboxed = load_chat_template(tmp_path, escape)
    assert sandboxed is not None
    with pytest.raises(TemplateRenderError, match="SecurityError|unsafe"):
        sandboxed.render(MESSAGES)
    dividing = tmp_path / "dividing.jinja"
    dividing.write_text("{{ 1 / 0 }}", encoding="utf-8")
    divides = load_chat_template(tmp_path, dividing)
    assert divides is not None
    with pytest.raises(TemplateRenderError, match="ZeroDivisionError"):
        divides.render(MESSAGES)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(InvalidConfig, match="broken.jinja"):
        load_chat_template(tmp_path, broken)
    assert load_chat_template(tmp_path / "draft") is None  # no tokenizer_config, no template
    assert load_chat_template(embedded.target_dir()) is not None  # ships chat_template.jinja


def test_chat_on_a_subword_checkpoint_equals_the_engine_on_hf_rendered_ids(tmp_path: Path) -> None:
    """`specstate serve --model DIR` (a subword checkpoint with a template) answers a chat with
    `Engine`'s greedy tokens on the ids ``apply_chat_template`` renders, streaming and not."""
    tok, _, draft = subword_checkpoint(tmp_path)
    _with_template(tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tmp_path), "--draft", str(draft), "--algorithm", "draft_model",
         "--num-steps", "3", "--kv-tokens", "2048"]
    )  # fmt: skip
    front, model = serve.build(args)
    assert model.chat_template is not None
    messages = MESSAGES[:2]
    try:
        with (
            BackgroundServer(create_app(front, model)) as server,
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            whole = chat(
                client, model=model.name, messages=messages, max_completion_tokens=12, temperature=0
            )
            chunks = list(
                chat(
                    client,
                    model=model.name,
                    messages=messages,
                    max_completion_tokens=12,
                    temperature=0,
                    stream=True,
                )
            )
    finally:
        bounded(front.close())
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ids = _hf_ids(hf, messages, tools=None, add_generation_prompt=True)
    worker = default_registry().create(
        "draft_model", target=str(tmp_path), draft=str(draft), num_steps=3
    )
    config = EngineConfig(kv_tokens=2048, check_invariants=True)
    with Engine(worker, limits=checkpoint_limits(tmp_path), config=config) as engine:
        req = engine.submit("c", ids, SamplingParams(max_new_tokens=12))
        engine.run_until_idle()
    expected = tok.decode(list(req.emitted_ids))
    choice = whole.choices[0]
    assert (choice.model_extra or {})["token_ids"] == list(req.emitted_ids)
    assert choice.message.content == expected
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected


def test_the_embedded_template_is_the_one_the_docs_show() -> None:
    """docs/serving.md shows the embedded model's chat template as it ships."""
    page = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
    shown = re.findall(r"```jinja\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    shipped = (embedded.target_dir() / "chat_template.jinja").read_text(encoding="utf-8")
    assert shown == [shipped]


def test_serve_takes_the_chat_template_flag(tmp_path: Path) -> None:
    """``specstate serve --chat-template FILE`` serves that template; without it the embedded
    model's own; ``--max-n`` reaches the app's limit on ``n``."""
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}", encoding="utf-8")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    for argv, origin in (
        (["--chat-template", str(override)], str(override)),
        ([], str(embedded.target_dir() / "chat_template.jinja")),
    ):
        front, model = serve.build(parser.parse_args(["--algorithm", "ngram", *argv]))
        bounded(front.close())
        assert model.chat_template is not None and model.chat_template.origin == origin
    assert parser.parse_args(["--max-n", "3"]).max_n == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-n", "0"])
