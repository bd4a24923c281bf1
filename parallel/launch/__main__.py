"""The entry point ``python -m parallel.launch``: runs the launcher's ``main`` and exits with its status."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
