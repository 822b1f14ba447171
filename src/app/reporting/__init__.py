"""What runs and sweeps leave behind for people: metric files, tables, pictures."""
