"""ringpack.analysis"""
