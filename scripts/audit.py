#!/usr/bin/env python
"""Independent evidence audit of a crl training run (docs/design.md §8): the command line over :mod:`crl.audit`.

    python scripts/audit.py RUN_DIR [--tolerance 5e-5]

Exit 0: every check passed; 1: some check failed or evidence is missing; 2: ``RUN_DIR`` is not a directory.
"""
import sys

from crl.audit import main

if __name__ == "__main__":
    sys.exit(main())
