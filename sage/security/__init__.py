"""Security primitives: the secret store, whom children run as, the bubblewrap probe, private key files."""
