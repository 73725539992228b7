"""The completion provider capsule (``llm``): see :mod:`capsules.llm.capsule`."""
