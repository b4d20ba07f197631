"""Tangram cpu_manager service."""
