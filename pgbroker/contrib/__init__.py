"""Integrations with other frameworks; each module imports its framework only when used."""
