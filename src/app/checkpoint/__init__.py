"""Checkpoints: the layout and its checks, the files, and the background writer."""
