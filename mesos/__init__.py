"""Pure library: GPU info -> Mesos agent flags (zlib-ng + base64url), and back."""
