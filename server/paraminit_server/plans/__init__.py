"""Plans: validation, resolution for the kernels, and the payloads and checkpoints they read."""
