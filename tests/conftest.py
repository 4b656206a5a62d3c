"""Puts tests/ on sys.path (pytest's prepend import mode) for the shared ``resume_helpers``."""
