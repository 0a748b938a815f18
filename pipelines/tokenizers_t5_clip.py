"""Offline CLIP and T5 tokenizers for the random-weight FLUX.1 and Wan2.1 pipelines.

FLUX.1 ships a CLIP tokenizer (``openai/clip-vit-large-patch14``) and a T5 one
(``google/t5-v1_1-xxl``); Wan2.1 a UMT5 one (``google/umt5-xxl``, the same T5 tokenizer class).
Nothing may be downloaded, so small vocabularies are made in-process from a few prompts (a BPE
trained with the ``tokenizers`` library for CLIP, a Unigram table written out for T5) and handed
to transformers' own ``CLIPTokenizer`` and ``T5Tokenizer`` classes, which add the real
normalisers, pre-tokenizers and post-processors around them. What the pipelines depend on is kept:

* CLIP: ``<|startoftext|>`` / ``<|endoftext|>`` around every prompt (pad is ``<|endoftext|>``, as
  released), ``model_max_length`` 77 (FluxPipeline reads it as the CLIP length), byte-level BPE
  with every byte and every byte-plus-``</w>`` in the vocabulary, so any text tokenizes without
  an unknown token. Special tokens are the last two ids, as in the release, so the pooled output
  is read at the first ``<|endoftext|>`` whichever way CLIPTextModel looks for it.
* T5: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 (T5Tokenizer hard-codes the unknown id), ``</s>``
  appended, a Unigram model (every printable ASCII character and the corpus words) behind T5's
  Metaspace pre-tokenizer. As with the released tokenizers,
  characters outside the vocabulary become ``<unk>``: any text tokenizes, not every character
  survives. No ``<extra_id_N>`` sentinels: the pipelines never use them.

The vocabularies have a few hundred entries, so their ids index any text encoder, tiny or full.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import string

from tokenizers import Tokenizer, pre_tokenizers, trainers
from transformers import CLIPTokenizer, T5Tokenizer

__all__ = [
    "CLIP_MAX_LENGTH",
    "T5_MAX_LENGTH",
    "build_clip_tokenizer",
    "build_t5_tokenizer",
]

logger = logging.getLogger(__name__)

CLIP_MAX_LENGTH = 77  # CLIP's position table: FluxPipeline pads and cuts the CLIP prompt here
T5_MAX_LENGTH = 512  # FluxPipeline's and WanPipeline's default max_sequence_length

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # in id order; T5Tokenizer expects exactly these ids

# The CLI's and the tests' prompts and a few common words, so typical prompts come out as whole
# words rather than single characters (only speed and readability depend on it).
_CORPUS = (
    "a red fox in the snow, golden hour",
    "a red cat holding a sign that says hello world",
    "a photo of a dog, bad quality, blurry, dance monkey",
    "a lighthouse at night, snowy mountains, a blue bird on a branch",
    "a cinematic shot of a woman walking in the rain, city street, neon lights, high detail",
    "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality",
)


@functools.lru_cache(maxsize=1)
def build_clip_tokenizer() -> CLIPTokenizer:
    """The offline CLIP tokenizer (built once per process, then shared: do not mutate it)."""
    # Trained through the real class's backend, so merges are learned on exactly the text its
    # normaliser (NFC, whitespace, lowercase) and pre-tokenizer (CLIP's regex, byte-level) produce.
    backend = Tokenizer.from_str(CLIPTokenizer().backend_tokenizer.to_str())
    trainer = trainers.BpeTrainer(
        vocab_size=2000,  # more than the corpus fills: every corpus word gets whole-word merges
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        end_of_word_suffix="</w>",
    )
    backend.train_from_iterator(_CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    # The trainer adds "x</w>" only for the x that end a corpus word; without all 256 of each
    # form an unseen character at the end of a word would become the unknown token.
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        for token in (symbol, symbol + "</w>"):
            vocab.setdefault(token, len(vocab))
    for token in (_CLIP_BOS, _CLIP_EOS):
        vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)
    logger.debug("offline CLIP tokenizer built: %d tokens", len(tok))
    return tok


@functools.lru_cache(maxsize=1)
def build_t5_tokenizer() -> T5Tokenizer:
    """The offline T5 tokenizer (built once per process, then shared: do not mutate it)."""
    # The Unigram vocabulary is written out rather than trained: on a corpus this small the
    # trainer keeps few whole words, and its pruning is free to change between releases.
    # Viterbi picks the segmentation with the highest total score, so a whole corpus word
    # (one piece) beats spelling it out (two or more characters).
    marker = "\u2581"  # SentencePiece's word-start marker, as T5Tokenizer's Metaspace writes it
    words = sorted({w.lower() for text in _CORPUS for w in re.findall(r"\w+", text)})
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = [(token, 0.0) for token in _T5_SPECIALS]
    pieces += [(marker + w, -1.0) for w in words]
    pieces += [(c, -2.0) for c in (marker, *chars)]
    pieces += [(marker + c, -2.0) for c in chars if marker + c not in dict(pieces)]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)
    logger.debug("offline T5 tokenizer built: %d tokens", len(tok))
    return tok
