"""The capsule author's API: the SDK, the worker side of an out-of-process capsule, installing a capsule."""
