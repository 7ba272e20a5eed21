"""Chat messages -> prompt token ids, through the checkpoint's chat template.

A checkpoint whose tokenizer has a `chat_template` renders with it (the template writes its own
special tokens, so the text is tokenized without adding more). One without a template (the tiny
test checkpoints, many base models) falls back to ChatML, the format `transformers` used as its
default template:

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n

tokenized as a plain prompt (BOS added where the tokenizer adds one).
"""

from __future__ import annotations

from typing import Any, Sequence

from rtpkv.errors import RequestError


Messages = Sequence[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool", "developer")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{j}] must be {{'type': 'text', 'text': str}}; "
                                   "only text content is supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts, "
                       f"got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Check the shape of `messages`; errors name the offending entry and field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role={role!r} is invalid; accepted: {', '.join(ROLES)}")
        out.append({"role": role, "content": _text(msg.get("content"), where)})
    return out


def render_chat(tokenizer: Any, messages: Any) -> list[int]:
    """Token ids of `messages` followed by the assistant's turn opener."""
    msgs = normalize_messages(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    text = tokenizer.apply_chat_template(msgs, chat_template=CHATML_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text).input_ids)
