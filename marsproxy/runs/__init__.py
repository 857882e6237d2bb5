"""What a live benchmark run (:mod:`marsproxy.bench`) and a simulated run (:mod:`marsproxy.sim`)
share: the workload (traces, arrivals, sessions, the ideal time), the command-line options, the
results and their report, plots and event time series, the progress bar."""
