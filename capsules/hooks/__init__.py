"""The hooks capsule: token-checked Claude Code hooks from astrid-emit (see capsule.py)."""
