"""How good the data is and how sure we are: calibration, the shadow audit,
candidate identity, statistics and the run summary."""
