"""The Kubernetes API: connection, the calls gpushared makes, and a node-scoped pod watch."""
