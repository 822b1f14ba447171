"""The modes other than training: evaluate, predict, export."""
