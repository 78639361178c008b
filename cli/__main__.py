"""`python -m postrain.cli ...` is the `postrain` command."""
from .main import run

run()
