"""Tangram gateway service."""
