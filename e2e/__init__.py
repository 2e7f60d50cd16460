"""End-to-end stress runner for a kvarn server, over HTTP only: ``python -m e2e.stress --help``."""
