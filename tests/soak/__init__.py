"""The standing adversarial suite (`make soak`): a wire fuzzer against a real supervisor.

Not part of `make test`: it runs for minutes.  ``python -m tests.soak --help``.
"""
