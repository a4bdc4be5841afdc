"""Prefect flows and the grpoflow command line.
Must not import: anything at import (``flows.cli`` is the console script's entry; each flow module is loaded by
whoever runs it).
"""
