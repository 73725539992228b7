"""Test doubles of the external programs sage runs (see fake_claude.py)."""
