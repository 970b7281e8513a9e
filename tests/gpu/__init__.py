"""Correctness on a CUDA GPU: README.md and conftest.py beside this file."""
