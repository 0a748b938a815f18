"""An offline Qwen2-style tokenizer for the random-weight pipelines.

The released Qwen-Image and Z-Image checkpoints ship Qwen2/Qwen3 tokenizers; the offline builders
must not download anything, so a small byte-level BPE is trained in-process on the prompt
templates instead. It keeps what the pipelines depend on:

* Qwen2's pre-tokenizer and a 256-symbol byte alphabet, so any text tokenizes;
* the chat special tokens (``<|im_start|>``, ``<|im_end|>``, vision tokens, ``<think>``);
* the Qwen-Image system prefix encodes to exactly 34 tokens, which QwenImagePipeline drops
  (its ``prompt_template_encode_start_idx``), so the text embeddings it keeps are the prompt's;
* a Qwen3-style chat template for ZImagePipeline's ``apply_chat_template`` call.

Token ids are small (the vocabulary has a few hundred entries), so they index into any text encoder
vocabulary, tiny or full size.
"""

from __future__ import annotations

import functools
import json
import logging

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

__all__ = [
    "QWEN_IMAGE_DROP_IDX",
    "QWEN_IMAGE_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "special_token_ids",
]

logger = logging.getLogger(__name__)

# The same string as QwenImagePipeline.prompt_template_encode.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# QwenImagePipeline drops this many leading tokens of the encoded template.
QWEN_IMAGE_DROP_IDX = 34

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # pad, eos and unk, as in Qwen2Tokenizer's defaults
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)

# ZImagePipeline calls apply_chat_template(..., add_generation_prompt=True, enable_thinking=True);
# with thinking enabled Qwen3's template adds nothing after the assistant header, so this minimal
# template renders the same text as the real one for single-turn prompts.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

_CORPUS = (
    QWEN_IMAGE_TEMPLATE.format("a red cat holding a sign that says hello world"),
    "a photo of a dog, bad quality, blurry, dance monkey",
)


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> Qwen2Tokenizer:
    """Return the offline tokenizer (built once per process, then shared).

    Training is deterministic, so every process gets the same vocabulary and ids. Callers must not
    mutate the returned object: it is shared by every pipeline the builders make.
    """
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        # Larger than the corpus can fill: every template word gets whole-word merges, which is
        # what makes the system prefix come out at the real tokenizer's 34 tokens.
        vocab_size=2000,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    # The pipelines truncate to their own max_sequence_length; this only silences length warnings.
    tok.model_max_length = 32768

    prefix_len = len(tok(QWEN_IMAGE_TEMPLATE.split("{}")[0]).input_ids)
    if prefix_len != QWEN_IMAGE_DROP_IDX:
        # A tokenizers release that trains differently would silently shift Qwen-Image's text
        # embeddings by some tokens; fail loudly instead.
        raise RuntimeError(
            f"offline tokenizer encodes the Qwen-Image system prefix to {prefix_len} tokens, "
            f"expected {QWEN_IMAGE_DROP_IDX}"
        )
    logger.debug("offline tokenizer built: %d tokens", len(tok))
    return tok


def special_token_ids(tokenizer: Qwen2Tokenizer | None = None) -> dict[str, int]:
    """Map each special token to its id in ``tokenizer`` (the offline one by default)."""
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
