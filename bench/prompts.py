"""The chat prompts of the generation benches (`postrain bench generate` and its speculative rows):
short distinct user questions, each rendered with the model's chat template.
"""
from __future__ import annotations

QUESTIONS = [
    "What is 17 + 25?", "Write a Python function that reverses a string.", "Name three prime numbers.",
    "Explain recursion in one sentence.", "What is the capital of Italy?", "Sort [3, 1, 2].",
    "What does HTTP stand for?", "Compute 6 * 7.", "Give a synonym for fast.",
    "What is a hash table?", "Translate 'good morning' to French.", "What is 2 to the power 10?",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` distinct chat prompts as token ids (the questions in turn, each tagged with its case
    number so that no two are equal)."""
    out = []
    for i in range(count):
        text = f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"
        out.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return out
