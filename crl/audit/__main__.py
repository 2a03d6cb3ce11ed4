"""``python -m crl.audit RUN_DIR``: the same command line as ``scripts/audit.py``."""
import sys

from crl.audit.report import main

sys.exit(main())
