"""The studies of rloo_lightning (not part of the installed package): one package per study, its scripts run as
modules from the repository's root, ``python -m experiments.<study>.<script> [args]``, so that they share
:mod:`benchmarks.bench_common` and each other's functions by plain imports (see ``experiments/README.md``)."""
