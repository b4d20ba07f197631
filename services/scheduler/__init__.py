"""Tangram scheduler service."""
