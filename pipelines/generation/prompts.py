"""How many tokens of a prompt the text encoder reads, so a cut prompt is said, not silent."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenCount:
    """``tokens`` the prompt takes as the pipeline encodes it; ``limit`` it reads at most."""

    tokens: int
    limit: int

    @property
    def truncated(self) -> bool:
        return self.tokens > self.limit

    def describe(self) -> str:
        """For the PNG text: ``"12"``, or ``"6210 (the first 512 read)"``."""
        return f"{self.tokens} (the first {self.limit} read)" if self.truncated else str(self.tokens)


def _default_max_length(pipe: Any) -> int | None:
    try:
        param = inspect.signature(pipe.__call__).parameters.get("max_sequence_length")
    except (TypeError, ValueError):
        return None
    default = getattr(param, "default", None)
    return default if isinstance(default, int) and default > 0 else None


def count_tokens(pipe: Any, prompt: str) -> TokenCount | None:
    """The tokens ``prompt`` takes in ``pipe``'s text encoder and how many it reads; None if unknown.

    Counted the way the two targets encode: Z-Image wraps the prompt in its tokenizer's chat
    template and truncates at ``max_sequence_length``; Qwen-Image formats it into
    ``prompt_template_encode``, drops the template's first ``prompt_template_encode_start_idx``
    tokens and keeps ``max_sequence_length`` (at most ``tokenizer_max_length``). Other pipelines
    encode in their own ways, so they are not counted rather than counted wrongly.
    """
    from diffusers import QwenImagePipeline, ZImagePipeline

    limit = _default_max_length(pipe)
    tokenizer = getattr(pipe, "tokenizer", None)
    if limit is None or tokenizer is None:
        return None
    if isinstance(pipe, ZImagePipeline):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        drop = 0
    elif isinstance(pipe, QwenImagePipeline):
        text = pipe.prompt_template_encode.format(prompt)
        drop = int(pipe.prompt_template_encode_start_idx)
        cap = getattr(pipe, "tokenizer_max_length", None)
        if isinstance(cap, int):
            limit = min(limit, cap)
    else:
        return None
    # verbose=False: counting a long prompt is the point, not something to warn about.
    tokens = len(tokenizer(text, truncation=False, verbose=False).input_ids) - drop
    return TokenCount(max(tokens, 0), limit)


class TruncationWarnings:
    """Counts each distinct prompt once and warns once for each that the encoder cuts."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._seen: dict[str, TokenCount | None] = {}

    @property
    def truncated(self) -> int:
        """How many distinct prompts were cut."""
        return sum(1 for c in self._seen.values() if c is not None and c.truncated)

    def check(self, prompt: str, what: str = "prompt") -> TokenCount | None:
        if prompt in self._seen:
            return self._seen[prompt]
        try:
            count = count_tokens(self.pipe, prompt)
        except Exception as e:  # a tokenizer without a chat template, say: unknown, not fatal
            logger.debug("cannot count the tokens of a %s: %s", what, e)
            count = None
        self._seen[prompt] = count
        if count is not None and count.truncated:
            shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
            logger.warning("the %s %r takes %d tokens but %s reads the first %d: the rest is ignored",
                           what, shown, count.tokens, type(self.pipe).__name__, count.limit)  # fmt: skip
        return count
