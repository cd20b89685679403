"""Helpers shared by the tests, one module per subject; test modules import only from here.

``plans`` random valid plans, ``attention`` attention problems and a dense reference, ``data`` small
datasets and coverage checks, ``brute`` brute-force figures, ``training`` the training-exactness
reference, ``cli`` running the command line in process.
"""
