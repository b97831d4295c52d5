"""``python -m anyattn``: see anyattn.cli."""
import sys

from .cli import main

sys.exit(main())
