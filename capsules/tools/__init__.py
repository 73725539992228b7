"""The tool bridge capsule: tool catalogue, checks, policy and calls on the bus (see bridge.py).

``catalogue.py`` (which capsule offers which tool, caps and name checks) and
``policy.py`` (allow/deny rules) are pure; ``bridge.py`` is the async shell.
"""
