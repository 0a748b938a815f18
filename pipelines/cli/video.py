"""Videos: every frame of a video pipeline's output in one file, the container from ``--out``'s
suffix, the run's text in the container's own metadata field.

=========  ==========================================  ==========================================
suffix     how                                         where the text is (one JSON object)
=========  ==========================================  ==========================================
``.webp``  animated WebP, lossless, Pillow (default)   EXIF ImageDescription (0x010E)
``.gif``   animated GIF, Pillow (256 colours a frame)  the GIF comment extension
``.mp4``   H.264 (yuv420p) through imageio and         the MP4 ``comment`` tag
           imageio-ffmpeg: the ``[video]`` extra
``.png``   the first frame only, as for images         PNG text chunks (``.jpg``: EXIF)
=========  ==========================================  ==========================================

:func:`read_video_text` reads the text back from any of them. WebP is lossless, so its frames
are the pipeline's frames as uint8, exactly; GIF keeps 256 colours a frame and H.264 is lossy.
WebP and GIF store two equal consecutive frames once, for both their times (their encoders do
so): the file plays the same, with fewer frames in it.

Frame times are whole milliseconds in WebP and hundredths of a second in GIF, so 16 fps (62.5
ms) cannot be one duration: each frame ends at its own time rounded (62, 63, 63, 62 ... ms), so
the times never drift and the whole is within half a unit of ``frames / fps``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..generation.errors import InputError, RunError, one_line
from ..generation.extras import install_command, missing
from ..generation.formats import IMAGE_SUFFIXES
from .files import write_whole

logger = logging.getLogger("bcg-generate")

# The files a video model's every frame goes into, by --out's suffix.
VIDEO_SUFFIXES = (".webp", ".gif", ".mp4")
DEFAULT_SUFFIX = ".webp"
EXTRA = install_command("video")
EXIF_IMAGE_DESCRIPTION = 0x010E
# Milliseconds in the unit of a frame's time: WebP's are whole milliseconds, GIF's hundredths of a second.
UNIT_MS = {".webp": 1, ".gif": 10}
FALLBACK_FPS = 16.0


@dataclasses.dataclass(frozen=True)
class VideoOutput:
    """How a run writes a video pipeline's output: ``suffix``, the container (``.png``: the
    first frame of each video, as an image); ``fps``, ``--fps`` (None: the model's default)."""

    suffix: str = DEFAULT_SUFFIX
    fps: float | None = None

    @property
    def every_frame(self) -> bool:
        return self.suffix in VIDEO_SUFFIXES


def check_mp4_extra() -> None:
    """InputError unless imageio and imageio-ffmpeg (with its ffmpeg) are installed."""
    absent = missing("video")
    if absent:
        raise InputError(f"--out .mp4 writes H.264 through imageio and imageio-ffmpeg, which are not installed "
                       f"({', '.join(absent)}): {EXTRA}, or write .webp")  # fmt: skip
    import imageio_ffmpeg

    try:
        imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:  # an imageio-ffmpeg without its binary and no ffmpeg on PATH
        raise InputError(f"--out .mp4: imageio-ffmpeg finds no ffmpeg ({one_line(e)[:160]}): {EXTRA}") from None


def plan_video_output(single: Path | None, video: bool | None, fps: float | None, model: str) -> VideoOutput | None:
    """What a run writes for ``model`` (``video``: it makes videos; None: not known before it is
    built), ``--out`` naming ``single`` (None: a folder); None where it writes images. InputError
    for ``--fps`` that has nothing to set or is beyond what the container stores, or ``.mp4``
    without the extra."""
    if video is False:
        if fps is not None:
            raise InputError(f"--fps {fps:g} sets a video's frame rate, but {model} makes images")
        return None
    suffix = single.suffix.lower() if single is not None else DEFAULT_SUFFIX
    if suffix not in VIDEO_SUFFIXES and fps is not None:
        raise InputError(f"--fps {fps:g}: --out {str(single)!r} writes each video's first frame only; "
                       "name a .webp, .gif or .mp4 file (or a folder) for the whole video")  # fmt: skip
    unit = UNIT_MS.get(suffix)
    if unit is not None and fps is not None and fps > 1000 / unit:
        name, what = ("WebP", "milliseconds") if unit == 1 else ("GIF", "hundredths of a second")
        raise InputError(f"--fps {fps:g}: {name} stores frame times in whole {what}, so at most "
                       f"{1000 // unit} fps; use .mp4")  # fmt: skip
    if suffix == ".mp4":
        check_mp4_extra()
    return VideoOutput(suffix, fps)


def settle_video_output(plan: VideoOutput | None, pipe: Any, single: Path | None,
                        fps: float | None) -> VideoOutput | None:  # fmt: skip
    """The plan of a run whose model was not known to make videos before it was built
    (:func:`plan_video_output` with ``video`` None), now that ``pipe`` is: kept for a video
    pipeline; None (image files) for an image pipeline, or InputError where ``--out`` or ``--fps`` asked for a video."""
    if takes_frames(type(pipe)):
        return plan
    name = type(pipe).__name__
    if single is not None and single.suffix.lower() in VIDEO_SUFFIXES and single.suffix.lower() not in IMAGE_SUFFIXES:
        raise InputError(f"--out {str(single)!r}: {name} makes images, written as PNG, JPEG or WebP; "
                       f"use {str(single.with_suffix('.png'))!r} (or a folder)")  # fmt: skip
    if fps is not None:
        raise InputError(f"--fps {fps:g} sets a video's frame rate, but {name} makes images")
    return None


def resolve_fps(plan: VideoOutput | None, pipe: Any) -> float:
    """``--fps``, else ``pipe``'s default frame rate (:func:`default_fps`), said in one log line."""
    if plan is not None and plan.fps is not None:
        return plan.fps
    fps, source = default_fps(type(pipe))
    logger.info("%g fps (%s; --fps sets another)", fps, source)
    return fps


def takes_frames(pipe_class: type) -> bool:
    """Whether a pipeline class makes videos: its call has ``num_frames``."""
    return "num_frames" in inspect.signature(pipe_class.__call__).parameters


def default_fps(pipe_class: type) -> tuple[float, str]:
    """A video pipeline's frame rate and where it comes from: its call's ``frame_rate`` (or
    ``fps``) default, which the model is conditioned on (LTX-Video: 25); else the rate diffusers'
    own example for the pipeline exports at (Wan: 16, HunyuanVideo-1.5: 15); else 16."""
    params = inspect.signature(pipe_class.__call__).parameters
    for name in ("frame_rate", "fps"):
        default = params[name].default if name in params else None
        if isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0:
            return float(default), f"{pipe_class.__name__}'s {name} default"
    example = getattr(inspect.getmodule(pipe_class), "EXAMPLE_DOC_STRING", None)
    match = re.search(r"export_to_video\([^)]*fps\s*=\s*(\d+(?:\.\d+)?)", example) if isinstance(example, str) else None
    if match is not None and float(match.group(1)) > 0:
        return float(match.group(1)), f"diffusers' example for {pipe_class.__name__}"
    return FALLBACK_FPS, f"no default known for {pipe_class.__name__}"


def video_text(text: Mapping[str, str], frames: int, fps: float) -> dict[str, str]:
    """The text of a video file: an image's (:func:`pipelines.generation.record.image_texts`) with its
    frame count and rate."""
    return {**text, "frames": str(frames), "fps": f"{fps:g}"}


def frame_durations(count: int, fps: float, unit_ms: int) -> list[int]:
    """Each frame's time in ``unit_ms`` milliseconds, frame ``k`` ending at ``(k + 1) / fps``
    rounded: no drift, however the rate divides."""
    ends = [round((k + 1) * 1000 / fps / unit_ms) for k in range(count)]
    return [unit_ms * (end - start) for start, end in zip([0, *ends], ends)]


def _write_webp(frames: Sequence[Any], part: Path, text: Mapping[str, str], fps: float) -> None:
    from PIL import Image

    exif = Image.Exif()
    exif[EXIF_IMAGE_DESCRIPTION] = json.dumps(dict(text))  # ASCII (EXIF's type for it), any prompt kept
    frames[0].save(part, format="WEBP", save_all=True, append_images=list(frames[1:]), lossless=True,
                   duration=frame_durations(len(frames), fps, UNIT_MS[".webp"]), loop=0, exif=exif)  # fmt: skip


def _write_gif(frames: Sequence[Any], part: Path, text: Mapping[str, str], fps: float) -> None:
    from PIL import Image

    # Each frame's own 256 colours by fast octree: far faster than Pillow's default (median cut),
    # and less error (docs/benchmarks.md).
    frames = [f.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE) for f in frames]
    frames[0].save(part, format="GIF", save_all=True, append_images=list(frames[1:]), loop=0,
                   duration=frame_durations(len(frames), fps, UNIT_MS[".gif"]), comment=json.dumps(dict(text)))  # fmt: skip


def _write_mp4(frames: Sequence[Any], part: Path, text: Mapping[str, str], fps: float) -> None:
    import imageio.v2 as imageio
    import numpy as np

    # crf 17: visually lossless H.264; faststart: a browser plays it before it has all of it.
    params = [
        "-crf",
        "17",
        "-movflags",
        "+faststart",
        "-metadata",
        f"comment={json.dumps(dict(text), ensure_ascii=False)}",
    ]
    writer = imageio.get_writer(part, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=None,
                                pixelformat="yuv420p", macro_block_size=16, output_params=params,
                                ffmpeg_log_level="error")  # fmt: skip
    try:
        for frame in frames:
            writer.append_data(np.asarray(frame.convert("RGB")))
    finally:
        writer.close()


_WRITERS = {".webp": _write_webp, ".gif": _write_gif, ".mp4": _write_mp4}


def save_video(frames: Sequence[Any], path: Path, text: Mapping[str, str], fps: float, overwrite: bool = False) -> Path:
    """Write the PIL ``frames`` of one video to ``path``, the container from its suffix, ``text``
    in its metadata; returns the path written. As :func:`pipelines.cli.files.save_png`: the file
    appears whole (a hidden ``.part`` file renamed), an existing one is replaced only with
    ``overwrite``, and a name taken meanwhile is kept, the video going to ``{stem}-N``."""
    suffix = path.suffix.lower()
    write = _WRITERS[suffix]
    try:
        # imageio picks its writer by the name's suffix, so the part file ends in it too.
        return write_whole(path, lambda part: write(frames, part, text, fps), overwrite, part_suffix=suffix)
    except RunError:
        raise
    except Exception as e:  # ffmpeg's or Pillow's encoder failing: one line
        raise RunError(f"cannot write {str(path)!r}: {type(e).__name__}: {one_line(e)[:300]}") from None


def read_video_text(path: str | Path) -> dict[str, str]:
    """The text bcg-generate wrote into a video file (WebP, GIF or MP4); ``{}`` where it holds none."""
    path = Path(path)
    suffix = path.suffix.lower()
    raw: str | bytes | None
    if suffix == ".mp4":
        import subprocess

        import imageio_ffmpeg

        dump = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "ffmetadata",
                               "-"], capture_output=True, text=True, check=True).stdout  # fmt: skip
        raw = _ffmetadata(dump).get("comment")
    else:
        from PIL import Image

        with Image.open(path) as im:
            raw = im.getexif().get(EXIF_IMAGE_DESCRIPTION) if suffix == ".webp" else im.info.get("comment")
    if not raw:
        return {}
    return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)


def _ffmetadata(dump: str) -> dict[str, str]:
    """ffmpeg's ``-f ffmetadata`` text as keys and values (``=``, ``;``, ``#``, ``\\`` and line
    ends are escaped with a backslash there)."""
    tags: dict[str, str] = {}
    for line in re.split(r"(?<!\\)\n", dump):
        key, eq, value = line.partition("=")
        if eq and not line.startswith((";", "#", "[")):
            tags[key] = re.sub(r"\\(.)", r"\1", value, flags=re.S)
    return tags
