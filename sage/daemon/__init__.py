"""The daemon: supervisor, capsule host, out-of-process workers, state store, logging, systemd."""
