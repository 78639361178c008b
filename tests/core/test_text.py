"""Counts in sentences (core/text.py)."""
from postrain.core.text import counted


def test_one_is_singular_and_others_plural():
    assert [counted(n, "held-out task") for n in (0, 1, 2)] == ["0 held-out tasks", "1 held-out task", "2 held-out tasks"]
    assert counted(3, "batch", "batches") == "3 batches"
