"""Measuring and explaining, what users call: sweeps (:mod:`.sweep`), the ``speclab bench`` subcommands (:mod:`.cli`,
flags shared through :mod:`.flags`; runners :mod:`.report`, :mod:`.compare`, :mod:`.bench_serve`,
:mod:`.bench_policies`, :mod:`.bench_synthetic`, :mod:`.bench_heads`), the cost model (:mod:`.costmodel`), the
roofline of named hardware (:mod:`.roofline`), and the advisor and ``speclab advise`` (:mod:`.advisor`,
:mod:`.advisor_cli`) with its validation against published measurements (:mod:`.published`). One-off experiments
live in the top-level ``benchmarks/`` folder."""
