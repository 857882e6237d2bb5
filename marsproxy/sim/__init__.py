"""Discrete-event simulator: the admission and scheduler cores, the emulated engine model
and a processor-sharing model of the tool CPUs, in virtual time."""
