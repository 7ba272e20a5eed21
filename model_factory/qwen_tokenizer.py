"""QWen's tiktoken tokenizer (`qwen.tiktoken`), without its remote code: the same byte-level BPE
over the same ranks and split pattern, converted to a `tokenizers` tokenizer by transformers'
TikTokenConverter and served as a PreTrainedTokenizerFast, so the pipeline treats it as any
other Hugging Face tokenizer. Its special tokens follow the ranks as QWen numbers them:
<|endoftext|>, <|im_start|>, <|im_end|>, then <|extra_0|> .. <|extra_204|>. Chat prompts use
ChatML (rtpkv/chat.py's fallback, QWen's own format), and <|im_end|> ends a turn. Needs the
`tiktoken` package (extra `qwen`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rtpkv.errors import ConfigError

VOCAB_FILE = "qwen.tiktoken"
# QWen's split pattern (tokenization_qwen.py's PAT_STR): one digit per piece
PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
ENDOFTEXT, IMSTART, IMEND = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IMSTART, IMEND) + tuple(f"<|extra_{i}|>" for i in range(205))


def load_qwen_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of a QWen checkpoint directory holding `qwen.tiktoken`."""
    try:
        import tiktoken  # noqa: F401  (TikTokenConverter reads the file with it)
    except ImportError:
        raise ConfigError(f"{model_dir / VOCAB_FILE}: QWen's tokenizer needs the tiktoken "
                          "package (pip install 'rtpkv[qwen]')") from None
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(model_dir / VOCAB_FILE), pattern=PATTERN,
                                extra_special_tokens=SPECIAL_TOKENS).converted()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=ENDOFTEXT,
                                   pad_token=ENDOFTEXT, model_max_length=1 << 20)


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a generation: <|endoftext|> and the end of a chat turn, <|im_end|>."""
    return tuple(tokenizer.convert_tokens_to_ids([ENDOFTEXT, IMEND]))
