"""A conversation -> token ids and which of them the loss trains on (the assistant turns' answers).

Two renderers, chosen by the tokenizer (`chat_renderer`):

* **the tokenizer's own template** (a Hugging Face tokenizer): the Jinja `chat_template` of the
  tokenizer's folder (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`), rendered
  as transformers' `apply_chat_template` renders it (a sandboxed environment with trim_blocks and
  lstrip_blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`, the
  tokenizer's special tokens as variables) and tokenized without added special tokens, so the ids
  equal `apply_chat_template(messages, tokenize=True)`. The answer of assistant turn i is the text
  between the rendering of turns [0, i) with the generation prompt and the rendering of turns
  [0, i] -- the answer, its end-of-turn token and what the template puts after it; every token that
  starts inside it is trained. A template that does not render a conversation's earlier turns as a
  prefix of the whole cannot be split this way and is refused. Needs `jinja2` (the `[chat]` extra).
* **the built-in template** (the byte tokenizer, which has no template of its own)::

      <BOS>System: {content}\\n\\n          (each system turn)
      User: {content}\\n\\n                  (each user turn)
      Assistant: {content}<EOS>              (each assistant turn; {content}<EOS> is trained)

  and the generation prompt is ``Assistant: ``.

An image part (image chat, `image/image_chat.py`) becomes one ``<|vision_start|><|image_pad|><|vision_end|>``: a
Jinja template gets transformers' content lists (``{"type": "image"}`` / ``{"type": "text", "text": ...}``)
and renders the image as a Qwen template does; the built-in template writes the three tokens' ids (those of
the job's `ImageSpec`; without one, their text `IMAGE_TEXT`).

Whatever the template, the loss trains on the assistant turns' tokens only: system and user turns
and the template's scaffolding (role headers) keep the ignore label.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from typing import Any, Protocol

from torchtrain.config.fields import ConfigError
from torchtrain.data.chat.records import ChatFormatError, Conversation
from torchtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, special_tokens

Rendered = tuple[list[int], list[bool]]  # token ids, trained (the token is an answer token to predict)

BUILTIN_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


class ChatRenderer(Protocol):
    name: str

    def render(self, conversation: Conversation) -> Rendered: ...

    def check(self, conversation: Conversation) -> None:
        """Raise ChatFormatError when `conversation` cannot be rendered (no tokenization)."""


IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
"""How the built-in template writes an image part (a Qwen-style template renders the same)."""


def as_text(content) -> str:
    """A turn's content as text: a string as is; parts joined, each image as `IMAGE_TEXT`."""
    if isinstance(content, str):
        return content
    return "".join(value if kind == "text" else IMAGE_TEXT for kind, value in content)


def as_messages(turns) -> list[dict]:
    """Turns as a chat template's `messages`: a string content as is, parts as transformers' content lists."""
    return [{"role": role, "content": content if isinstance(content, str) else
             [{"type": "text", "text": v} if k == "text" else {"type": "image"} for k, v in content]}
            for role, content in turns]


class BuiltinRenderer:
    """The documented built-in template (module docstring), for the byte tokenizer."""

    name = "built-in"
    identity = "built-in"
    """What decides the rendering, stored with prepared chat data (`chat/token_store.py`)."""

    def __init__(self, tokenizer: Tokenizer, image_ids: tuple[int, int, int] | None = None):
        self.tokenizer = tokenizer
        self.image_ids = image_ids
        """(vision start, image pad, vision end) ids an image part is written as; None: as `IMAGE_TEXT`."""

    def _encode(self, content, suffix: str, eos: bool) -> list[int]:
        """A turn's content and `suffix` as ids (module doc: images as `image_ids`)."""
        tok = self.tokenizer
        if isinstance(content, str) or self.image_ids is None:
            return tok.encode(as_text(content) + suffix, bos=False, eos=eos)
        ids = []
        for kind, value in content:
            ids += list(self.image_ids) if kind == "image" else tok.encode(value, bos=False, eos=False)
        return ids + tok.encode(suffix, bos=False, eos=eos)

    def check(self, conversation: Conversation) -> None:
        pass  # any conversation with known roles renders

    def render(self, conversation: Conversation) -> Rendered:
        tok = self.tokenizer
        ids = [tok.bos_id] if tok.bos_id is not None else []
        trained = [False] * len(ids)
        for role, content in conversation.turns:
            head = tok.encode(BUILTIN_HEADERS[role], bos=False, eos=False)
            ids += head
            trained += [False] * len(head)
            if role == "assistant":
                body = self._encode(content, "", eos=True)
                trained += [True] * len(body)
            else:
                body = self._encode(content, "\n\n", eos=False)
                trained += [False] * len(body)
            ids += body
        return ids, trained

    def generation_prompt(self, conversation: Conversation) -> list[int]:
        ids, _ = self.render(conversation) if conversation.turns else ([self.tokenizer.bos_id], [])
        return ids + self.tokenizer.encode(BUILTIN_HEADERS["assistant"], bos=False, eos=False)


def find_chat_template(folder: str) -> tuple[str, str, dict[str, str]] | None:
    """(template, the file it came from, special-token variables) of a tokenizer folder, or None."""
    config_file = os.path.join(folder, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            return f.read(), jinja_file, special_tokens(config)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and template:
        return template, config_file, special_tokens(config)
    return None


def compile_template(template: str, where: str):
    """The template compiled in a sandbox configured as transformers configures it."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatFormatError(f"{where}: rendering a tokenizer's chat template needs the `jinja2` package: "
                              f"pip install 'torchtrain[chat]'") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatFormatError(f"{where}: the chat template does not compile: {e}") from None


class JinjaRenderer:
    """A Hugging Face tokenizer's own chat template (module docstring)."""

    def __init__(self, tokenizer: HFTokenizer, template: str, file: str, variables: dict[str, str]):
        self.tokenizer, self.file, self.variables = tokenizer, file, variables
        self.name = f"the chat template of {file}"
        self.identity = "sha256:" + hashlib.sha256(template.encode()).hexdigest()
        self.template = compile_template(template, file)

    def text(self, turns: tuple[tuple[str, str], ...], add_generation_prompt: bool, where: str) -> str:
        messages = as_messages(turns)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (raise_exception, type errors)
            raise ChatFormatError(f"{where}: {self.name} fails to render this conversation: "
                                  f"{type(e).__name__}: {e}") from None

    def spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its answers."""
        turns, where = conversation.turns, conversation.where
        full = self.text(turns, False, where)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            start = len(self.text(turns[:i], True, where))
            upto = self.text(turns[:i + 1], False, where)
            if not full.startswith(upto) or len(upto) < start:
                raise ChatFormatError(f"{where}: {self.name} does not render the turns before assistant turn {i} "
                                      f"as a prefix of the whole conversation, so its answer cannot be located")
            spans.append((start, len(upto)))
        return full, spans

    def check(self, conversation: Conversation) -> None:
        self.spans(conversation)

    def render(self, conversation: Conversation) -> Rendered:
        full, spans = self.spans(conversation)
        ids, offsets = self.tokenizer.encode_with_offsets(full)
        trained = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        return ids, trained

    def generation_prompt(self, conversation: Conversation) -> list[int]:
        return self.tokenizer.encode_with_offsets(self.text(conversation.turns, True, conversation.where))[0]


def chat_renderer(tokenizer: Tokenizer, key: str = "model.hf_assets_path", image_spec=None
                  ) -> BuiltinRenderer | JinjaRenderer:
    """The renderer for `tokenizer`; ConfigError naming `key` when it has no usable chat template.
    `image_spec` (`images.ImageSpec`): the image token ids the built-in template writes."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = None if image_spec is None else (image_spec.vision_start_id, image_spec.image_pad_id,
                                               image_spec.vision_end_id)
        return BuiltinRenderer(tokenizer, ids)
    if isinstance(tokenizer, HFTokenizer):
        folder = os.path.dirname(tokenizer.file)
        found = find_chat_template(folder)
        if found is None:
            raise ConfigError(f"[{key}] {folder} has no chat template (chat_template.jinja, or chat_template in "
                                  f"tokenizer_config.json): add the model's template there")
        try:
            return JinjaRenderer(tokenizer, *found)
        except ChatFormatError as e:
            raise ConfigError(f"[{key}] {e}") from None
    raise ConfigError(f"[{key}] chat data needs a Hugging Face tokenizer (tokenizer.json with its chat "
                          f"template) or the built-in byte tokenizer; {type(tokenizer).__name__} has no chat template")
