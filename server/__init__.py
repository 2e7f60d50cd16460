"""The OpenAI-compatible HTTP server and the ``kvarn`` command. Uses only ``engine``'s public API."""
