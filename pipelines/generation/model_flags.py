"""The model flags: which pipeline, on which device, how it is accelerated and warmed up.

:func:`add_model_arguments` adds them to any parser, and :func:`model_settings` reads them back
checked, as a :class:`ModelSettings`, before torch is imported. ``bcg-generate`` takes them with
its own flags; another front end (a server, say) takes the same ones::

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    settings = model_settings(parser.parse_args())

and hands the settings to :func:`pipelines.generation.prepare.load_pipeline`. A new flag that changes
the model or how it is accelerated belongs here, with its field in :class:`ModelSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import textwrap
from pathlib import Path
from typing import Any

from ..families.catalog import known_model
from ..lora import LoraError, LoraSpec, check_lora_file
from . import values
from .caches import CacheRequest, cache_request, support_text
from .checks import check_compile_cache
from .constants import CACHES, DEFAULT_MODEL, DTYPES, accel_options
from .errors import InputError
from .extras import install_command

Size = tuple[int, int]


def add_model_arguments(parser: argparse.ArgumentParser, *, named_loras: bool = False,
                        parallel: bool = True) -> argparse._ArgumentGroup:  # fmt: skip
    """Add the model flags to ``parser``, in a group of their own, which is returned.

    ``named_loras``: ``--lora`` takes ``NAME=FILE[:SCALE]``, adapters loaded at start and picked
    by name later (a server's requests), instead of ``FILE[:SCALE]``, adapters that all run.
    ``parallel``: whether ``--parallel`` is offered (one image on several processes; a front end
    that can only run in one process leaves it out).
    """
    options = accel_options()
    p = parser.add_argument_group("model and acceleration")
    p.add_argument(
        "--model",
        type=values.model,
        default=DEFAULT_MODEL,
        help="'z-image' (default; built offline with random weights), 'qwen-image', 'flux' (FLUX.1-dev), "
        "'wan' (Wan2.1-T2V-14B), 'wan-1.3b', a local pipeline folder or a Hugging Face hub id (org/name)",
    )
    p.add_argument(
        "--size",
        choices=("tiny", "full"),
        default=None,
        help="size of the built-in random-weight models (default tiny; full needs a GPU); a folder or hub "
        "model is loaded as it is",
    )
    p.add_argument(
        "--transformer",
        type=values.safetensors_file,
        default=None,
        metavar="FILE",
        help="a single-file .safetensors checkpoint of the denoiser (a fine-tune, say), loaded with diffusers' "
        "from_single_file into --model's pipeline in place of its own, with its config",
    )
    p.add_argument(
        "--scheduler",
        type=values.scheduler_name,
        default=None,
        metavar="NAME",
        help="a diffusers scheduler class the model's scheduler lists as compatible (e.g. "
        "FlowMatchHeunDiscreteScheduler), made from its config (default: the model's own)",
    )
    p.add_argument(
        "--warmup",
        type=values.warmup_size,
        nargs="+",
        action="extend",
        default=None,
        metavar="WxH",
        help="resolutions to capture before the first image (default: those generated; 'none' skips)",
    )
    p.add_argument(
        "--mode",
        choices=options.MODES,
        default=None,
        help="bcg: CUDA graphs (default); debug: same runner, denoiser eager; eager: no acceleration",
    )
    if parallel:
        p.add_argument(
            "--parallel",
            choices=options.PARALLEL_MODES,
            default=None,
            help="under accelerate launch / torchrun, compute each image on all processes together (cfg: the two "
            "guidance branches on 2 GPUs, exact; ulysses: diffusers' context parallelism; cfg+ulysses: both, 4+ "
            "GPUs); every process runs every call with the same seeds; rank 0 writes the files (bcg-serve: rank 0 serves)",
        )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the denoiser's repeated blocks with inductor and capture the graphs over the "
        "compiled kernels (CUDA only; the first run compiles, later runs reuse the cache)",
    )
    p.add_argument(
        "--compile-cache",
        type=values.path,
        default=None,
        metavar="DIR",
        help=f"folder of the persistent compile cache (default {options.default_compile_cache_dir()}); "
        "delete it to clear the cache",
    )
    p.add_argument(
        "--quantize",
        choices=options.QUANTIZE_MODES,
        default=None,
        help="fp8: the denoiser's Linear layers in float8 (lossy; a CUDA GPU of compute capability 8.9 or newer, "
        f"bf16 weights, {install_command('fp8')}); the warmup measures them and keeps the worst in bf16 "
        f"until the latents are within {options.DEFAULT_FP8_BUDGET:.0%} of bf16".replace("%", "%%"),
    )
    p.add_argument(
        "--no-text-encoder-graphs",
        dest="text_encoder_graphs",
        action="store_false",
        help="run the text encoders eagerly (default: a graph per prompt token length, captured by the warmup)",
    )
    p.add_argument(
        "--no-vae-graphs",
        dest="vae_graphs",
        action="store_false",
        help="run the VAE decoder eagerly (default: a graph per latent shape, in the denoiser's graph pool)",
    )
    p.add_argument(
        "--no-cfg-batch",
        dest="cfg_batch",
        action="store_false",
        help="run true CFG's two denoiser calls one after the other (default: one call at twice the batch "
        "where the text is padded anyway, e.g. Qwen-Image up to 768x768)",
    )
    p.add_argument(
        "--no-auto-breaks",
        dest="auto_breaks",
        action="store_false",
        help="when a capture fails on an operation a graph cannot hold, only name it (default: run the function "
        "that did it as an eager break and capture again, kept only if equal to eager)",
    )
    p.add_argument(
        "--cache",
        choices=CACHES,
        default=None,
        help="skip denoiser work on steps whose result barely changes: fbc (First Block Cache), taylorseer, "
        "magcache (diffusers' hooks) or dbcache (cache-dit, an optional extra); applied before acceleration",
    )
    p.add_argument(
        "--cache-threshold",
        type=values.positive,
        default=None,
        metavar="FLOAT",
        help="fbc, magcache, dbcache: how much change a step may skip (higher: faster, less exact; "
        "default each method's own)",
    )
    p.add_argument(
        "--cache-interval",
        type=values.positive_int,
        default=None,
        metavar="INT",
        help="taylorseer: compute every INT-th step, predict the others (default 5)",
    )
    p.add_argument(
        "--cache-ratios",
        type=values.ratios,
        default=None,
        metavar="R1,R2,...",
        help="magcache (required): the model's calibrated magnitude ratios, one per step (resampled to --steps)",
    )
    p.add_argument("--lora", type=values.lora, action="append", default=[], **_lora_help(named_loras))
    p.add_argument(
        "--device", default=None, help="torch device: cpu, cuda, cuda:N (default cuda if available, else cpu)"
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weights dtype (default bfloat16 on cuda, float32 on cpu)"
    )
    return p


def _lora_help(named: bool) -> dict[str, str]:
    """``--lora``'s metavar and help: what each front end takes, in one place."""
    loaded = "with diffusers' load_lora_weights before the step cache and the accelerator"
    if named:
        return dict(metavar="NAME=FILE[:SCALE]",
                    help=f"a LoRA .safetensors file for the denoiser, at SCALE (default 1.0; repeat for several), "
                    f"loaded at start as adapter NAME {loaded}; none is active until a request names one "
                    '("lora": NAME), and a request without one gets the base model')  # fmt: skip
    return dict(metavar="FILE[:SCALE]",
                help=f"a LoRA .safetensors file for the denoiser, at SCALE (default 1.0; repeat for several, which run "
                f"together), loaded {loaded}, then set_adapters; recorded in each image's text")  # fmt: skip


def _compile_cache_line() -> str:
    options = accel_options()
    folder = options.default_compile_cache_dir()
    line = f"compile cache: --compile keeps compiled kernels in {folder}"
    env = os.environ.get(options.COMPILE_CACHE_ENV)
    if env and folder.exists() and not folder.is_dir():
        line += f"\n  (${options.COMPILE_CACHE_ENV} names a file, not a folder: --compile refuses it)"
    return line


def _indented(text: str) -> str:
    """``text`` as an epilog paragraph's continuation: wrapped, each line indented by two."""
    return textwrap.fill(text, width=98, initial_indent="  ", subsequent_indent="  ")


def model_epilog() -> str:
    """The help's paragraphs on the model flags: the step caches and the compile cache."""
    env = accel_options().COMPILE_CACHE_ENV
    return f"""\
step caches (--cache): fbc, diffusers' First Block Cache (--cache-threshold, default 0.05);
  taylorseer, diffusers' TaylorSeer (--cache-interval, default 5); magcache, diffusers' MagCache
  (--cache-ratios, calibrated for the model, required; --cache-threshold, default 0.06);
  dbcache, cache-dit's DBCache (--cache-threshold, its residual_diff_threshold, default 0.08;
  {install_command("cache-dit")}).
{_indented(support_text() + ".")}

{_compile_cache_line()}
  (--compile-cache DIR, else ${env}, else $XDG_CACHE_HOME or ~/.cache, then
  bcg-diffusers/compile; a TORCHINDUCTOR_CACHE_DIR you set wins over the default).
  Delete that folder to clear the cache."""


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The model flags, checked: what :func:`pipelines.generation.prepare.prepare_pipeline` builds.

    ``mode_flag``, ``device`` and ``dtype`` are the flags as given (None: not given), so that
    errors can say what was asked; :attr:`mode` is what runs. ``warmup``: the sizes to capture
    before the first call; None: those the calls use; empty: none. ``loras``: the adapters
    loaded into the denoiser after the build (their files checked), run together at their scales.
    """

    model: str = DEFAULT_MODEL
    size: str = "tiny"
    mode_flag: str | None = None
    device: str | None = None
    dtype: str | None = None
    parallel: str | None = None
    compile: bool = False
    compile_cache: Path | None = None
    cache: CacheRequest | None = None
    warmup: tuple[Size, ...] | None = None
    text_encoder_graphs: bool = True
    vae_graphs: bool = True
    cfg_batch: bool = True
    auto_breaks: bool = True
    loras: tuple[LoraSpec, ...] = ()
    quantize: str | None = None
    max_entries: int | None = None  # graphs kept per denoiser (None: the library's default)
    transformer: Path | None = None
    scheduler: str | None = None

    @property
    def mode(self) -> str:
        """The accelerator's mode: ``--mode``, else ``bcg``."""
        return self.mode_flag or "bcg"

    @property
    def accelerated(self) -> bool:
        """Whether ``accelerate_pipeline`` is called (always but in mode eager without --parallel)."""
        return self.mode != "eager" or self.parallel is not None

    def dtype_name(self, device_type: str) -> str:
        """The weights' dtype: ``--dtype``, else bfloat16 on CUDA and float32 elsewhere."""
        if self.dtype:
            return DTYPES[self.dtype]
        return "bfloat16" if device_type == "cuda" else "float32"

    def accelerate_options(self) -> dict[str, Any]:
        """``accelerate_pipeline``'s keyword arguments besides ``mode``: only those not at their default,
        so a front end keeps working with an accel that lacks one it was not asked for."""
        options: dict[str, Any] = {}
        if self.parallel is not None:
            options["parallel"] = self.parallel
        if self.compile:
            options["compile"] = True
            if self.compile_cache is not None:
                options["compile_cache_dir"] = self.compile_cache
        if not self.text_encoder_graphs:
            options["text_encoder"] = False
        if not self.vae_graphs:
            options["vae"] = False
        if not self.auto_breaks:
            options["auto_breaks"] = False
        if not self.cfg_batch:
            options["cfg_batch"] = False
        if self.quantize is not None:
            options["quantize"] = self.quantize
        if self.max_entries is not None:
            options["max_entries"] = self.max_entries
        return options


def model_settings(args: argparse.Namespace) -> ModelSettings:
    """The model flags of ``args`` (parsed by a parser :func:`add_model_arguments` built), checked
    together; InputError for flags that do not fit. Imports no torch."""
    parallel = getattr(args, "parallel", None)
    size = _size(args.model, args.size)
    warmup: tuple[Size, ...] | None = None
    if args.warmup is not None:
        if None in args.warmup and any(w is not None for w in args.warmup):
            raise InputError("--warmup takes resolutions or 'none', not both")
        warmup = tuple(dict.fromkeys(w for w in args.warmup if w is not None))
    if args.compile and (args.mode or "bcg") == "eager":
        raise InputError("--compile prepares graph capture, which --mode eager never does: drop one of them")
    if args.quantize is not None:
        _check_quantize_flags(args.quantize, args.mode or "bcg", parallel, warmup)
    cache = cache_request(args.cache, args.cache_threshold, args.cache_interval, args.cache_ratios)
    if args.compile_cache is not None:
        check_compile_cache(args.compile_cache)
        if not args.compile:
            raise InputError("--compile-cache is the folder of --compile's kernel cache: add --compile")
    elif args.compile:
        options = accel_options()
        if os.environ.get(options.COMPILE_CACHE_ENV):  # the default folder is checked where it comes from a user
            check_compile_cache(options.default_compile_cache_dir(), f"${options.COMPILE_CACHE_ENV}")
    loras = tuple(getattr(args, "lora", None) or ())
    for spec in loras:  # the cheap part, each file's header, before anything is built; the rest needs the model
        try:
            check_lora_file(spec)
        except LoraError as e:
            raise InputError(f"--lora {e}") from None
    return ModelSettings(
        model=args.model,
        size=size,
        mode_flag=args.mode,
        device=args.device,
        dtype=args.dtype,
        parallel=parallel,
        compile=args.compile,
        compile_cache=args.compile_cache,
        cache=cache,
        warmup=warmup,
        text_encoder_graphs=args.text_encoder_graphs,
        vae_graphs=args.vae_graphs,
        cfg_batch=args.cfg_batch,
        auto_breaks=args.auto_breaks,
        loras=loras,
        quantize=args.quantize,
        transformer=getattr(args, "transformer", None),
        scheduler=getattr(args, "scheduler", None),
    )


def _size(model: str, size: str | None) -> str:
    """``--size`` for ``model``: a built-in model's (default tiny); InputError where it is given for a
    model it cannot size (a folder, a hub id, a single file), which loads its own weights as they are."""
    if known_model(model) is not None:
        return size or "tiny"
    if model.lower().endswith((".safetensors", ".ckpt", ".bin", ".pt", ".pth", ".gguf")):
        raise InputError(f"--model {model!r} is a file of weights, not a pipeline: name the pipeline it belongs to with "
                       "--model (z-image, a folder, a hub id) and give a denoiser's single file as --transformer "
                       "FILE")  # fmt: skip
    if size is not None:
        raise InputError(f"--size {size} sizes the built-in random-weight models; --model {model!r} loads its own "
                       "weights as they are: drop --size")  # fmt: skip
    return "tiny"


def _check_quantize_flags(quantize: str, mode: str, parallel: str | None, warmup: tuple[Size, ...] | None) -> None:
    if mode == "eager" and parallel is None:
        raise InputError(
            f"--quantize {quantize} is applied by the accelerator, which --mode eager skips: drop one of them"
        )
    if parallel is not None:
        raise InputError(f"--quantize {quantize} does not combine with --parallel yet: drop one of them")
    if warmup == ():
        raise InputError(f"--quantize {quantize} measures its layers in the warm-up: drop --warmup none")


def check_quantize(settings: ModelSettings, device: Any, dtype: Any) -> None:
    """``--quantize`` against the device and dtype, before anything is built: InputError where it
    cannot run (a CPU, a GPU below compute capability 8.9, torchao missing, weights not bf16)."""
    if settings.quantize is None:
        return
    from accel import check_quantize as refusal

    flag = f"--quantize {settings.quantize}"
    try:
        refusal(settings.quantize, device)
    except ValueError as e:
        raise InputError(str(e).replace(f"quantize={settings.quantize!r}", flag)) from None
    if str(dtype) != "torch.bfloat16":
        name = str(dtype).removeprefix("torch.")
        raise InputError(f"{flag} makes its float8 weights from bfloat16 ones: use --dtype bfloat16, not {name}")
