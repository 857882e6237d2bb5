"""marsproxy: admission control and agent-centric scheduling in front of unmodified vLLM."""

__version__ = "0.1.0"
