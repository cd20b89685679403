"""ringpack.attention"""
