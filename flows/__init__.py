"""Prefect flows and the grpoflow command line."""
