"""Train a speculative drafter: `jaxdec distill` as a script (the CLI parses the flags).

    python scripts/train_drafter.py --target smollm2 --drafter small --out runs/small \
        --steps 300 --batch 8 --n-prompts 256 --n-new 64 --layers 4
"""

import sys

from jaxdec.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["distill", *sys.argv[1:]]))
