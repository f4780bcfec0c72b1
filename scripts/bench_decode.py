"""Decode speed of jaxdec and its peers (HF transformers, llama.cpp), side by side.

    python scripts/bench_decode.py [--model smollm2] [--weights f32,gguf] [--peers hf,llama.cpp]
                                   [--batches 1,8,32,64] [--json report.json]

The same as `jaxdec bench`; the peers come from `make bench`. See jaxdec/bench/.
"""

import sys

from jaxdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
