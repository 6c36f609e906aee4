"""Thin entry points: parse arguments, build the components, run them. No logic of their own."""
