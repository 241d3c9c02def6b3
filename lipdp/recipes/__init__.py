"""Ready-made networks and runs shared by the command line, the tutorials, the benchmarks
and the tests: the model zoo (:mod:`lipdp.recipes.zoo`), the runs of ``lipdp train`` and
``lipdp evaluate`` without the command line (:mod:`lipdp.recipes.runs`,
:mod:`lipdp.recipes.run_evaluation`, with the per-data-set constants of
:mod:`lipdp.recipes.defaults`) and the private hyper-parameter search
(:mod:`lipdp.recipes.tuning`). Nothing here parses arguments or prints: the command
(:mod:`lipdp.cli`) builds on the recipes, never the other way round."""
