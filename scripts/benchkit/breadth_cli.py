"""The command line of scripts/bench_breadth.py: its flags and the defaults that depend on the device."""

from __future__ import annotations

import argparse

VARIANTS = ("eager", "graphs", "compiled")
SEED = 0
FULL_TIMEOUT_S = 150
TINY_TIMEOUT_S = 120


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _steps(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in _csv(text)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps takes integers like 2,4, got {text!r}") from None
    if len(values) < 2 or values[0] < 2:
        raise argparse.ArgumentTypeError(f"--steps needs two or more different counts of at least 2, got {text!r}")
    return values


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for breadth.json, breadth.md and logs/")
    p.add_argument("--only", type=_csv, default=None, help="comma-separated families (default: all)")
    p.add_argument("--size", choices=("tiny", "full"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument(
        "--variants", type=_csv, default=None, help="comma-separated of eager,graphs,compiled (default: eager,graphs)"
    )
    p.add_argument("--steps", type=_steps, default=[2, 4], help="the measured step counts (default 2,4)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per step count; the median is kept (default 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per family, its build included (default {FULL_TIMEOUT_S} full, {TINY_TIMEOUT_S} tiny)",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=SEED, help="seed of the weights, the embeddings and the noise")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in each child (default: torch's)")
    p.add_argument(
        "--decode",
        action="store_true",
        help='decode every call with the VAE (output_type="pt"): end to end includes the decode, and the decoded images are compared',
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one family
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # internal: the child's result file
    return p


def resolve(args: argparse.Namespace, names: tuple[str, ...]) -> argparse.Namespace:
    """Defaults that depend on the device; ValueError naming a bad value."""
    if args.only is not None:
        unknown = [n for n in args.only if n not in names]
        if unknown or not args.only:
            raise ValueError(
                f"--only: unknown families {', '.join(unknown) or '(none given)'}; known: {', '.join(names)}"
            )
    variants = args.variants if args.variants is not None else ["eager", "graphs"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    # Fixed order, eager first: every ratio is against eager of the same process.
    args.variants = [v for v in VARIANTS if v in variants or v == "eager"]
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here")
    cuda = args.device == "cuda"
    args.size = args.size or ("full" if cuda else "tiny")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.timeout is None:
        args.timeout = float(FULL_TIMEOUT_S if args.size == "full" else TINY_TIMEOUT_S)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    return args
