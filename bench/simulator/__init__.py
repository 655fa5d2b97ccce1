"""Capacity simulator: the cluster's own bucketing policies over simulated time, with calibrated costs.

* :mod:`bench.simulator.cost_model` -- prefill, decode-step and KV-transfer costs, fitted from the real engine
  or projected from accelerator figures;
* :mod:`bench.simulator.sim` -- the discrete-event simulation (disaggregated and colocated);
* :mod:`bench.simulator.calibrate` -- measures the engine on this machine and fits the cost model;
* :mod:`bench.simulator.validate` -- simulated vs measured SLO attainment on a live cluster;
* :mod:`bench.simulator.capacity` -- curves and the prefill:decode split for a target rate;
* :mod:`bench.simulator.cli` -- the ``bucketserve simulate`` command.

Its results (calibrations, validations, projections) are kept in ``bench/reports/``.
"""
