"""The zoo's families as data, one module per family (two for Wan2.1 in one), in the order of
:data:`pipelines.zoo.names.NAMES`.

Each full config is the ``transformer/config.json`` (or ``unet/``) of the named hub repository,
written as constructor kwargs; where diffusers' constructor defaults already are that release
they are read from the class (:func:`pipelines.construction.init_defaults`) rather than repeated,
and a scheduler's config states only what differs from its class's defaults.
FLUX.1-dev, Wan2.1 and Qwen-Image come from the built-in models' data (:mod:`pipelines.releases`).
Their parameter counts are checked against the released models' in the tests. The tiny configs
keep every structural choice (block types, patch sizes, latent channels and VAE scale factors,
text streams) at a few layers and narrow widths.

Embedding shapes are those the pipeline's own text encoders produce at the release's usual text
length: for example FLUX.1's T5-XXL ``(1, 512, 4096)`` and pooled CLIP-L ``(1, 768)``. The
geometry is each release's usual resolution (a short clip for video). :mod:`.common` holds what
several families share. The families, one module each: ``flux``, ``flux2``, ``sd3``, ``sdxl``,
``wan`` (14B and 1.3B), ``ltx``, ``hunyuan_video``, ``hunyuan_video_15``, ``sana``,
``pixart_sigma``, ``chroma``, ``cogview4``, ``hidream``, ``lumina2`` and ``qwen_image_edit``.
"""

from __future__ import annotations

from ..spec import Family
from . import (
    chroma,
    cogview4,
    flux,
    flux2,
    hidream,
    hunyuan_video,
    hunyuan_video_15,
    ltx,
    lumina2,
    pixart_sigma,
    qwen_image_edit,
    sana,
    sd3,
    sdxl,
    wan,
)

__all__ = ["ALL"]

ALL: tuple[Family, ...] = (
    flux.FAMILY,
    flux2.FAMILY,
    sd3.FAMILY,
    sdxl.FAMILY,
    wan.WAN_14B,
    wan.WAN_1_3B,
    ltx.FAMILY,
    hunyuan_video.FAMILY,
    hunyuan_video_15.FAMILY,
    sana.FAMILY,
    pixart_sigma.FAMILY,
    chroma.FAMILY,
    cogview4.FAMILY,
    hidream.FAMILY,
    lumina2.FAMILY,
    qwen_image_edit.FAMILY,
)
