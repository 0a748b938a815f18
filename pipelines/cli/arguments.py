"""The ``bcg-generate`` parser: the model flags, what to generate, where the images go.

Each value is checked as it is read (:mod:`pipelines.generation.values`), and nothing here imports
torch, diffusers or accel's package: ``--help`` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..families.catalog import video_model_names
from ..generation import values
from ..generation.constants import (
    DEFAULT_PROMPT,
    MAX_GUIDANCE,
    MAX_STEPS,
    MEMORY_MARGIN,
    accel_options,
    package_version,
)
from ..generation.errors import InputError
from ..generation.formats import FORMATS
from ..generation.model_flags import add_model_arguments, model_epilog

PROG = "bcg-generate"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + error
        raise InputError(f"{message} (see {PROG} --help)")

    def _parse_optional(self, arg_string: str) -> Any:
        # The only short option is -h, so "-5x5" after --resolution or "-fox" after --prompt is a
        # value, never an option: without this, argparse says "expected one argument" and the
        # real mistake (a negative size) goes unnamed, or a prompt cannot start with "-".
        if arg_string.startswith("-") and not arg_string.startswith("--") and arg_string not in ("-", "-h"):
            return None
        return super()._parse_optional(arg_string)


def _epilog() -> str:
    multiple = accel_options().RESOLUTION_MULTIPLE
    return f"""\
limits (checked before the model runs or anything is written; see pipelines/limits.py):
  resolution  multiples of {multiple}, at most what the model's position table can place
              (z-image: 8192x8192, from its RoPE axes_lens [1024, 512, 512] at 16 pixels a token;
              qwen-image: 98320 a side, from its 4096-row RoPE table; flux and wan compute
              their rotary positions as they go), and no more than the device's free memory
              fits, by an estimate of the VAE decode, the denoiser's activations and the graph
              pool, times {MEMORY_MARGIN} (for wan, of one frame: the estimate knows no video)
  --steps     1 (2 for qwen-image's scheduler) to {MAX_STEPS}: the scheduler's
              num_train_timesteps (more steps only repeat the noise levels it was trained on)
  --seed      0 to 2**63 - 1; image i uses seed + i, so the last image's seed must fit too
  --guidance  0 to {MAX_GUIDANCE:g} (the models here run at 0 to 7.5; far above, every step overshoots)
  --frames    video models only ({", ".join(video_model_names())}), 4k+1: the VAE packs 4 frames into
              each latent after the first
  --size full builds z-image's 10B, qwen-image's 29B, flux's 17B (FLUX.1-dev), wan's 20B
              (Wan2.1-T2V-14B) or wan-1.3b's 7B parameters, text encoders included:
              it needs a CUDA GPU with room for their weights; on a CPU it is refused
  prompts     the text encoder reads a limited number of tokens (512 for every built-in model;
              flux's CLIP encoder, whose pooled output it also reads, 77); a longer prompt is
              cut there, with a warning that gives the counts for z-image and qwen-image

videos: a video model (wan) writes every frame, as an animated WebP (lossless, Pillow) by default;
  --out x.gif writes a GIF, --out x.mp4 an H.264 MP4 (pip install "bcg-diffusers[video]"),
  --out x.png the first frame only. The frame rate is --fps, else the model's (wan: 16); a
  model conditioned on its frame rate (LTX-Video's frame_rate) is called at it too. The
  text a PNG holds goes into the video's own metadata field, as JSON: WebP's EXIF
  ImageDescription, GIF's comment, MP4's comment tag (pipelines.cli.video.read_video_text).

files: an image that already exists is never replaced unless --overwrite is given: the new one
  goes to the first free name {{stem}}-N, said before the model is built (so a command runs again
  and again); a file that appears while the run generates (another run writing to the same place)
  is kept too. Each file's record (prompt, seed, steps, model, the mode that ran ...) is in PNG
  text chunks, or a JPEG's or WebP's EXIF, and as A1111's "parameters" that image browsers read
  (pipelines.generation.formats.read_image_text reads it back).

input images: --image FILE gives an edit model (Qwen-Image-Edit, FLUX.1 Kontext ...) its image;
  any other model is run as the image-to-image pipeline diffusers makes from it (z-image,
  qwen-image, flux), --mask FILE as its inpainting pipeline; --strength sets how much is redrawn.

layers: a layered model (qwen-image-layered: --image FILE split into RGBA layers) writes each
  image as one file a layer, NAME-layer0.png, NAME-layer1.png ... (NAME the image's file name
  without its suffix, --out x.png's too), alpha kept, each with its record and its "layer"; PNG
  or WebP (JPEG has no alpha: refused). The run's last line says how many layers an image.

{model_epilog()}

exit status: 0 done, 1 loading or generating failed, 2 bad input, 130 interrupted (Ctrl-C),
  143 terminated (SIGTERM).
multi-GPU: accelerate launch --num_processes N scripts/generate.py ... splits the work; with
  --parallel every process works on every image together and only rank 0 writes files.
"""


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """What to generate: prompts, sizes, frames, steps, guidance, seeds, batch size."""
    multiple = accel_options().RESOLUTION_MULTIPLE
    p = parser.add_argument_group("what to generate")
    p.add_argument(
        "--prompt",
        type=values.prompt,
        action="append",
        default=[],
        help=f"a prompt (repeat for several; default {DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--negative-prompt",
        type=values.check_utf8,
        default=None,
        help="negative prompt (used only when guidance is on)",
    )
    p.add_argument(
        "--prompts-file",
        type=values.path,
        default=None,
        help="a UTF-8 text file with one prompt a line (blank lines and #-comments skipped)",
    )
    p.add_argument(
        "--resolution",
        type=values.resolution,
        nargs="+",
        action="extend",
        default=None,
        metavar="WxH",
        help=f"one or more WIDTHxHEIGHT, multiples of {multiple} (default 512x512; wan: 832x480, "
        "its 480p, at --size full and 256x256 tiny)",
    )
    p.add_argument(
        "--frames",
        type=values.positive_int,
        default=None,
        metavar="N",
        help="video models: frames per video, 4k+1 (default for wan 33 at --size full, 5 tiny; another video "
        "pipeline: its own)",
    )
    p.add_argument(
        "--steps",
        type=values.steps,
        default=None,
        help=f"denoising steps, 1 to {MAX_STEPS} (default: 9 for z-image, 20 for qwen-image, 28 for flux, else 30)",
    )
    p.add_argument(
        "--guidance",
        type=values.guidance,
        default=None,
        help="Z-Image guidance_scale / Qwen-Image true_cfg_scale / FLUX.1-dev's distilled guidance_scale (no CFG) / "
        f"Wan guidance_scale, 0 to {MAX_GUIDANCE:g} (default 0.0 / 4.0 / 3.5 / 5.0)",
    )
    p.add_argument(
        "--seed",
        type=values.seed,
        default=0,
        help="seed of the first image, 0 to 2**63 - 1; image i uses seed + i (default 0)",
    )
    p.add_argument("--width", type=values.side, default=None, metavar="W",
                   help="image width: the same as --resolution WxH with --height (default: the model's)")  # fmt: skip
    p.add_argument("--height", type=values.side, default=None, metavar="H",
                   help="image height (with --width, or alone: the model's default width)")  # fmt: skip
    p.add_argument("--batch-size", type=values.positive_int, default=1, help="images per prompt per pipeline call")
    p.add_argument("--num-images", type=values.positive_int, default=None, metavar="N",
                   help="images per prompt and resolution, made in calls of --batch-size (default: --batch-size, "
                   "one call)")  # fmt: skip
    p.add_argument("--image", type=values.path, default=None, metavar="FILE",
                   help="an input image: an edit model's (its pipeline takes one), else image-to-image with the "
                   "pipeline diffusers makes from the model (the same weights); the output size defaults to its size")  # fmt: skip
    p.add_argument("--mask", type=values.path, default=None, metavar="FILE",
                   help="with --image: what to repaint (inpainting): white repainted, black kept; an image with "
                   "transparency is read as OpenAI's mask (its transparent pixels repainted)")  # fmt: skip
    p.add_argument("--strength", type=values.unit_interval, default=None, metavar="S",
                   help="with --image: how much of it is noised again, above 0 to 1 (1: all; default the "
                   "pipeline's, 0.6 for image-to-image)")  # fmt: skip


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the images (and videos) go, at what frame rate, and what the run prints."""
    p = parser.add_argument_group("output")
    p.add_argument(
        "--out",
        type=values.out_path,
        default=Path("outputs"),
        help="a .png, .jpg or .webp file for a single image, else a folder (default outputs/); a video model's: "
        "a .webp (default in a folder), .gif or .mp4 file, or .png/.jpg for its first frame",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="the images' format in a folder (default png; a single --out file's suffix says its own): png "
        "(lossless), jpeg or webp (lossless unless --quality), each with the run's record",
    )
    p.add_argument("--quality", type=values.quality, default=None, metavar="Q",
                   help="JPEG's (default 95) or lossy WebP's quality, 1 to 100")  # fmt: skip
    p.add_argument(
        "--fps",
        type=values.positive,
        default=None,
        help="video models: frames per second of the file written, and of the call of a model conditioned on "
        "it (LTX-Video's frame_rate; default: the model's, 16 for wan)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace images that already exist (default: refuse, before the model is built)",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print the accelerator's counters at the end, for the denoiser and each graphed component",
    )
    p.add_argument("--quiet", action="store_true", help="only warnings and errors: no progress bars or info logs")
    p.add_argument("--json", action="store_true",
                   help="print the run's summary as one JSON object on stdout (files, seeds, timings, what ran); "
                   "the summary line goes to stderr")  # fmt: skip
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


def build_parser() -> argparse.ArgumentParser:
    """The ``bcg-generate`` argument parser."""
    parser = _Parser(
        prog=PROG,
        description="Generate images with a diffusers pipeline whose denoiser replays breakable CUDA graphs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_epilog(),
    )
    add_model_arguments(parser)
    add_generation_arguments(parser)
    add_output_arguments(parser)
    return parser
