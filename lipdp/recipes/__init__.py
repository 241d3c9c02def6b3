"""Ready-made networks and runs shared by the command line, the tutorials, the benchmarks
and the tests: the model zoo (:mod:`lipdp.recipes.zoo`), the runs of ``lipdp train`` and
``lipdp evaluate`` without the command line -- their configuration
(:mod:`lipdp.recipes.recipe_config`, which setting applies to which method in
:mod:`lipdp.recipes.method_settings`), their compiled model
(:mod:`lipdp.recipes.model_factory`), their training (:mod:`lipdp.recipes.runs`) and
evaluation (:mod:`lipdp.recipes.run_evaluation`), with the per-data-set constants of
:mod:`lipdp.recipes.defaults` -- and the private hyper-parameter search
(:mod:`lipdp.recipes.tuning`). Nothing here parses arguments or prints: the command
(:mod:`lipdp.cli`) builds on the recipes, never the other way round."""
