"""The one control plane: admission, scheduling, placement and tool phases composed, pure.

The gateway and the simulator drive only :class:`marsproxy.policy.plane.ControlPlane`; they
feed it events (requests, calls, ticks with observations, store answers, session ends) and
carry out what it returns.
"""
