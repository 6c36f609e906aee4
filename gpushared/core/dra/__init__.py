"""What the DRA driver decides: slices, claims, prepare, its records, each container's share. Read by gpushared.dra."""
