"""Support for the project's tests: `faults` (fault injection into real training processes)."""
