"""The run directory: its name, who owns it (one command at a time), and its record."""
