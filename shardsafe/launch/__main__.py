"""``python -m shardsafe.launch launch|agent|control ...``: the same as ``shardsafe launch|agent|control ...``."""
import sys

from .cli import main

sys.exit(main())
