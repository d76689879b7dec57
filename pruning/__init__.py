"""Structural channel pruning with torch-pruning, aligned to Tensor Core widths."""
