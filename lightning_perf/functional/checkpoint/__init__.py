"""Activation checkpointing: which blocks, under which memory budget, and applying it."""
