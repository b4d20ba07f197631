"""Tangram services: one package each; they never import each other and talk over NATS."""
