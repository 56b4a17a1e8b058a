"""Synthetic multi-agent tasks, their chat template, and the quality evaluation harness (`braid eval`)."""
