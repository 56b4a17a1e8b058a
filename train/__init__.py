"""Training Braid's reference model from scratch on synthetic workflow traces."""
