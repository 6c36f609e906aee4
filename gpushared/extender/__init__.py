"""The scheduler extender: filter, prioritize and bind over a watch-fed cache, and inspect."""
