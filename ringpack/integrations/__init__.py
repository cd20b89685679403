"""Integrations of ringpack's attention runtime with model libraries.

See docs/integrations.md.
"""
