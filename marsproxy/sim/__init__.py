"""Discrete-event simulator: the admission core and scheduler pieces, the emulated engine model
and a processor-sharing model of the tool CPUs, in virtual time."""
