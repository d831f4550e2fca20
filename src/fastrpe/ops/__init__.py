"""Stateless algorithms. Each op folder has `naive.py` (the reference: same
signature, no cleverness) beside its fast versions."""
