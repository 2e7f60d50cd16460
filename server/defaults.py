"""Defaults the ``kvarn`` command needs before MLX may be imported (no imports here)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
API_KEY_ENV = "KVARN_API_KEY"
