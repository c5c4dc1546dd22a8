"""Speed and memory measurements of rloo_lightning (not part of the installed package).

A package of the repository's root, so that its scripts and the studies' (``experiments/``) share
:mod:`benchmarks.bench_common` by plain imports, and so that ``python -m benchmarks <name> [args]`` (from the
repository's root) runs any of them: see ``__main__.py`` and ``benchmarks/README.md``.
"""
