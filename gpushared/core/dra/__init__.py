"""What the DRA driver decides: slices, claims, prepare, its records, each container's share. Pure; the driver
that acts on it is ``gpushared.daemon.dra``."""
