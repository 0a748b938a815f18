"""Generate images from the command line (the same as the ``bcg-generate`` console script).

python scripts/generate.py --prompt "a red fox in the snow" --out outputs/fox.png
accelerate launch --num_processes 2 scripts/generate.py --prompts-file samples/prompts.txt
"""

from pipelines.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
