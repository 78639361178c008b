"""`python -m postrain.cli ...` is the `postrain` command."""
import sys

from .main import main

sys.exit(main())
