"""The installer capsule: writes a principal's home for its modes (see capsule.py)."""
