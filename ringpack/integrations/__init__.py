"""Integrations of ringpack's attention runtime with model libraries."""
