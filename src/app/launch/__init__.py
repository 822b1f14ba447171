"""Where a job runs and how its processes start, are watched and end (imported without torch)."""
