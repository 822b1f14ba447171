"""app's launchers for SLURM and local submitit jobs: hydra-submitit-launcher, extended."""
