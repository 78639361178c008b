"""The fault-injection tests import their harness (fault_harness.py, beside this file) by name."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
