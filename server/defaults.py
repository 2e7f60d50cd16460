"""Defaults the ``kvarn`` command needs before MLX may be imported (no imports here)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
API_KEY_ENV = "KVARN_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # 16 MiB: far more than any context's text, far less than memory
