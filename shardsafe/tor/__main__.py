"""``python -m shardsafe.tor report RUN_DIR ...``: the same as ``shardsafe tor ...``."""
import sys

from .cli import main

sys.exit(main())
