"""``make faults``: issue 13's fault and abuse table on real processes (docs/faults.md); the
entry point is ``kvgate_tools.faults.run``."""
