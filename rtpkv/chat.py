"""Chat messages -> prompt token ids, through the checkpoint's chat template.

A checkpoint whose tokenizer has a `chat_template` renders with it (the template writes its own
special tokens, so the text is tokenized without adding more). One without a template (the tiny
test checkpoints, many base models) falls back to ChatML, the format `transformers` used as its
default template:

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n

tokenized as a plain prompt (BOS added where the tokenizer adds one).

With a `task_id`, the task's prompt stands in for the system message: it is the request's
prefix, and the chat is rendered without a system turn of its own (not the template's default
one either, which templates such as Qwen's insert when no system message is given); a system
message beside a task_id is refused.
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


_SYSTEM_MARK = "\x00rtpkv-task-prompt\x00"


def _render(tokenizer: Any, msgs: list[dict[str, str]], generation: bool) -> str:
    own = getattr(tokenizer, "chat_template", None)
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation,
                                         **({} if own else {"chat_template": CHATML_TEMPLATE}))


def _after_system_turn(tokenizer: Any, msgs: list[dict[str, str]]) -> str:
    """The rendered chat with its system turn cut off: rendered behind a marker system
    message (so no default one is added), less what the marker's turn alone renders to."""
    if any(m["role"] == "system" for m in msgs):
        raise RequestError("a request with a task_id takes no system message: the task's prompt "
                           "is the system prompt")
    system = [{"role": "system", "content": _SYSTEM_MARK}]
    head = _render(tokenizer, system, generation=False)
    text = _render(tokenizer, system + msgs, generation=True)
    if _SYSTEM_MARK not in head or not text.startswith(head):
        raise RequestError("this checkpoint's chat template cannot render messages after a "
                           "task prompt; send the prompt as text with the task_id")
    return text[len(head):]


def render_chat(tokenizer: Any, messages: Any, after_task_prompt: bool = False,
                generation: bool = True) -> list[int]:
    """Token ids of `messages` followed by the assistant's turn opener (`generation`; without
    it, the messages alone: what a prefix of the chat renders to); `after_task_prompt`:
    without a system turn, to follow a task prompt (no special tokens added)."""
    msgs = normalize_messages(messages)
    if after_task_prompt:
        text = _after_system_turn(tokenizer, msgs)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    text = _render(tokenizer, msgs, generation=generation)
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)
