"""app: a Hydra-composed experiment launcher and DDP trainer for PyTorch."""
