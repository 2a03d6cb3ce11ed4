#!/usr/bin/env python
"""Rebuild the shipped tokenizer (crl/modules/assets/tokenizer.json) from crl.modules.tokenizer's word lists.

The build is deterministic: rerunning it rewrites byte-identical output. ``--check`` only verifies that the
shipped file is current (exit status 1 if not).
"""
import argparse
import sys
from pathlib import Path

from crl.modules.tokenizer import ASSET_PATH, VOCABULARY, build_tokenizer_json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ASSET_PATH, help="where to write (default: the shipped asset)")
    parser.add_argument("--check", action="store_true", help="verify --out equals a fresh build; write nothing")
    args = parser.parse_args()
    fresh = build_tokenizer_json().encode("utf-8")
    if args.check:
        current = args.out.read_bytes() if args.out.exists() else b""
        print(f"{args.out}: {'up to date' if current == fresh else 'STALE (run scripts/build_tokenizer.py)'}")
        return 0 if current == fresh else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(fresh)
    print(f"wrote {args.out} ({len(VOCABULARY)} tokens, {len(fresh)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
