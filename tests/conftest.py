"""Puts tests/ on the import path, for the helpers every test folder shares (``processes.py``)."""
