"""ringpack.analysis

See docs/analysis.md.
"""
