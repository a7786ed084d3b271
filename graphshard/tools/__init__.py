"""Tools around the library: the CLI, graph dump, demo training, local launcher, calibration."""
