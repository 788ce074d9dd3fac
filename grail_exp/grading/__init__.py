"""Grading completions: the reward (math-verify in a process pool), answer extraction, boxed answers."""
