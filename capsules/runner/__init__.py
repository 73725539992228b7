"""The session runner capsule: Claude Code sessions on the bus (see runner.py)."""
