"""What two sides of sage agree on, spelled once: the error codes (``codes``) and the
contract between the session runner and the fleet (``sessions``).  Sans-IO; both
sides import it, it imports neither."""
