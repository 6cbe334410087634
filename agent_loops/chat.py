"""Chat messages in, token ids out: a chat template rendered token-exactly.

`ChatFormat` renders OpenAI-style messages (role system / user / assistant / tool, content,
tool_calls) and OpenAI function schemas with a Jinja chat template, the one the tokenizer
ships (`tokenizer.chat_template`) or a named one of `chat_templates/` (`model.chat_template`).

Two properties make multi-turn rollouts token-exact:
  - Message content never becomes a special token. The template is rendered with a
    placeholder for every message's content; the template's own text is tokenized with
    its special tokens (role markers such as <|im_start|>), each content on its own with
    `split_special_tokens=True`, and the pieces are joined. A tool that prints "<|im_end|>"
    gives text, not an end of turn. Where the tokenizer has no special token for one of the
    template's markers (tags such as <|im_end|> or <tool_response> in its own text), the marker
    is plain text to it, and content spelling it would tokenize exactly like the template's
    own: in contents, such markers have their "<" written as "&lt;". A template whose
    end-of-turn marker is plain text that is not such a tag is refused.
  - Appending messages only appends tokens. The model's turns are kept as sampled; a tool
    or environment message is added as the tokens the template renders for it: the
    rendering of a reference conversation with the messages, minus the rendering without
    them. That rendering must start with the one without them (same text, same token
    ids), or the difference is not what the template would give the whole conversation;
    `ChatFormat` checks this on a probe conversation and refuses templates that fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.tasks import Problem

TEMPLATES_DIR = Path(__file__).parent / "chat_templates"
# Stands in for a message's content while rendering; never produced by a tokenizer or a model.
_PLACEHOLDER = "\x00content{}\x00"
_PLACEHOLDER_RE = re.compile("\x00content(\\d+)\x00")
# The reference conversation tool messages are appended to (only its shape matters for a
# prefix-stable template), and the content of the probe messages of the prefix check.
_REFERENCE = ({"role": "user", "content": "u"}, {"role": "assistant", "content": "a"})
_PROBE_TOOLS = ({"role": "tool", "name": "probe", "content": "1"}, {"role": "tool", "name": "probe", "content": "2"})
# A conversation with every role, a tool call and a tool offered: the template's own text around it
# holds its markers.
_PROBE_SCHEMA = {"type": "function", "function": {"name": "probe", "description": "p", "parameters": {}}}
_PROBE_CONVERSATION = ({"role": "system", "content": "s"}, *_REFERENCE,
                       {"role": "assistant", "content": "c", "tool_calls": [
                           {"type": "function", "function": {"name": "probe", "arguments": {}}}]},
                       *_PROBE_TOOLS)
# What a template's markers look like: tags (<|im_start|>, </tool_response>, <|eot_id|>, <tool_call>).
_MARKER_RE = re.compile(r"<[^<>\s]{1,64}>")

Message = dict[str, Any]


class ChatTemplateError(ValueError):
    """A chat template that cannot be used for token-exact multi-turn rollouts."""


def named_templates() -> list[str]:
    """The names of the templates shipped in chat_templates/ (`model.chat_template`)."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def load_named_template(name: str) -> str:
    """The Jinja source of the shipped template `name`."""
    path = TEMPLATES_DIR / f"{name}.jinja"
    if not path.is_file():
        raise ChatTemplateError(f"unknown chat template {name!r}; shipped templates: {', '.join(named_templates())}")
    return path.read_text()


@dataclass(frozen=True)
class EndOfTurn:
    """How an assistant turn ends: `closing` are the tokens the template puts after the
    turn's content (e.g. "<|im_end|>\\n"); generation stops at its first part, a single
    special token (`stop_token_ids`) or text (`stop`)."""

    closing: tuple[int, ...]
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]


class ChatFormat:
    """A tokenizer and a chat template, checked to be prefix-stable (module docstring)."""

    def __init__(self, tokenizer: Any, template: str | None = None, name: str = ""):
        template = template if template is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatTemplateError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
                                    f"set model.chat_template to one of: {', '.join(named_templates())}")
        self.tokenizer = tokenizer
        self.template = template
        self.name = name or "the tokenizer's chat template"
        self.text_markers = self._text_markers()
        self._escape_re = re.compile("|".join(map(re.escape, self.text_markers))) if self.text_markers else None
        self.end_of_turn = self._end_of_turn()
        self._check_prefix_stable()

    # -- rendering ----------------------------------------------------------------------

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
        """The token ids of the conversation; no content creates a special token."""
        text, contents = self._render_text(messages, tools, add_generation_prompt)
        return self._tokenize(text, contents)

    def prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt of a conversation: rendered with the generation prompt (the opening of
        the assistant's turn)."""
        return self.render(messages, tools, add_generation_prompt=True)

    def append_ids(self, messages: list[Message], response_tail: list[int]) -> list[int]:
        """The tokens that follow an assistant turn ending in `response_tail` when `messages`
        (tool results, an environment's reply) come next, up to the next turn's generation
        prompt: what the turn's closing still lacks (a turn stopped at its end-of-turn token
        already holds that token) and the messages as the template renders them."""
        before = self.render(list(_REFERENCE))
        after = self.render([*_REFERENCE, *messages], add_generation_prompt=True)
        if after[: len(before)] != before:
            raise self._not_prefix_stable("adding messages changes the tokens of the conversation before them")
        closing = self.end_of_turn.closing
        done = next(k for k in range(len(closing), -1, -1) if k == 0 or list(closing[:k]) == response_tail[-k:])
        return list(closing[done:]) + after[len(before):]

    def _render_text(self, messages: list[Message], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool) -> tuple[str, list[str]]:
        """The rendered text with a placeholder for each string content, and the contents."""
        contents: list[str] = []
        masked = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and content:
                masked.append({**message, "content": _PLACEHOLDER.format(len(contents))})
                contents.append(content)
            else:
                masked.append(message)
        text = self.tokenizer.apply_chat_template(masked, tools=tools or None, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)
        found = [int(i) for i in _PLACEHOLDER_RE.findall(text)]
        if found != list(range(len(contents))):
            raise ChatTemplateError(f"chat template {self.name}: renders message contents other than once each and "
                                    "in order (it changes or drops them), so they cannot be tokenized apart")
        return text, contents

    def _tokenize(self, text: str, contents: list[str]) -> list[int]:
        pieces = _PLACEHOLDER_RE.split(text)  # template text, content index, template text, ...
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            else:
                ids += self.tokenizer(self.escape(contents[int(piece)]), add_special_tokens=False,
                                      split_special_tokens=True)["input_ids"]
        return ids

    def escape(self, content: str) -> str:
        """`content` with each of the template's plain-text markers written with "&lt;" for its "<"."""
        return self._escape_re.sub(lambda m: "&lt;" + m[0][1:], content) if self._escape_re else content

    # -- checks -------------------------------------------------------------------------

    def _text_markers(self) -> tuple[str, ...]:
        """The template's markers that this tokenizer reads as plain text (not one special token)."""
        found: set[str] = set()
        # Templates refuse some shapes (no system role, no tool calls): each probe that renders counts.
        for conversation in (_PROBE_CONVERSATION, _PROBE_CONVERSATION[1:], _REFERENCE):
            for tools in (None, [_PROBE_SCHEMA]):
                try:
                    text, _ = self._render_text(list(conversation), tools, add_generation_prompt=True)
                except Exception:  # noqa: BLE001  (jinja's and the template's own errors alike)
                    continue
                found.update(_MARKER_RE.findall(_PLACEHOLDER_RE.sub("", text)))
        special = set(self.tokenizer.all_special_ids)

        def is_special(marker: str) -> bool:
            ids = self.tokenizer(marker, add_special_tokens=False)["input_ids"]
            return len(ids) == 1 and ids[0] in special

        return tuple(sorted(m for m in found if not is_special(m)))

    def _end_of_turn(self) -> EndOfTurn:
        """What the template writes after an assistant turn's content."""
        user, assistant = _REFERENCE
        opened, _ = self._render_text([user], None, add_generation_prompt=True)
        whole, _ = self._render_text([user, assistant], None, add_generation_prompt=False)
        head = opened + _PLACEHOLDER.format(1)
        if not whole.startswith(head):
            raise self._not_prefix_stable("an assistant turn is not rendered as the generation prompt followed by "
                                          "its content")
        closing_text = whole[len(head):]
        marker = closing_text.strip()
        if not marker:
            raise ChatTemplateError(f"chat template {self.name}: an assistant turn has no end-of-turn marker")
        closing = tuple(self.tokenizer(closing_text, add_special_tokens=False)["input_ids"])
        marker_ids = self.tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(marker_ids) == 1 and marker_ids[0] in set(self.tokenizer.all_special_ids):
            # a special token never shows in the detokenized text a stop string is matched on
            return EndOfTurn(closing, (), (marker_ids[0],))
        if marker not in self.text_markers:
            raise ChatTemplateError(f"chat template {self.name}: its end-of-turn marker {marker!r} is plain text to "
                                    "this tokenizer and not a tag that message contents can be escaped from, so tool "
                                    "output could end a turn and forge the next; use a tokenizer with it as a special "
                                    "token or another template (model.chat_template)")
        return EndOfTurn(closing, (marker,), ())

    def _check_prefix_stable(self) -> None:
        """Appending tool messages one turn at a time gives what rendering them at once gives."""
        first, second = _PROBE_TOOLS
        conversation = [*_REFERENCE, first, {"role": "assistant", "content": "b"}, second]
        whole = self.render(conversation, add_generation_prompt=True)
        stepwise = self.render(list(_REFERENCE))
        stepwise += self.append_ids([first], stepwise)
        stepwise += self._assistant_turn_ids("b")
        stepwise += self.append_ids([second], stepwise)
        if stepwise != whole:
            raise self._not_prefix_stable("rendering a conversation turn by turn gives other tokens than rendering "
                                          "it whole")

    def _assistant_turn_ids(self, content: str) -> list[int]:
        """An assistant turn's content as the model would generate it, up to its end-of-turn marker."""
        ids = self.tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + list(self.end_of_turn.closing[:1])

    def _not_prefix_stable(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"chat template {self.name} is not prefix-stable ({what}): multi-turn rollouts "
                                 "could not keep the model's tokens as sampled; use another template "
                                 "(model.chat_template)")


_FORMATS: dict[tuple[int, str], ChatFormat] = {}


def chat_format(tokenizer: Any, template_name: str = "") -> ChatFormat:
    """The (cached) ChatFormat of a tokenizer: its own template, or the shipped one named."""
    template = load_named_template(template_name) if template_name else getattr(tokenizer, "chat_template", None)
    key = (id(tokenizer), template or "")
    fmt = _FORMATS.get(key)
    if fmt is None or fmt.tokenizer is not tokenizer:
        fmt = _FORMATS[key] = ChatFormat(tokenizer, template, template_name)
    return fmt


def prompt_token_ids(problem: Problem, tokenizer: Any) -> list[int]:
    """A problem's prompt: its messages rendered with the tokenizer's chat template (tools
    offered), or its prompt text encoded; [] for an empty prompt."""
    if problem.messages:
        return chat_format(tokenizer).prompt(problem.messages, problem.tools)
    return tokenizer.encode(problem.prompt) if problem.prompt.strip() else []
