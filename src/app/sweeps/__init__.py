"""What a sweep leaves and how it is checked: the summary (`summary.csv`, `summary.md`,
`summary.png`) and the Hydra callback that keeps it, and a sweep directory's identity checks.
What one run leaves is app.reporting."""
