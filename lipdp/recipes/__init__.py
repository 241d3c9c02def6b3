"""Ready-made networks and runs shared by the command line, the tutorials, the benchmarks
and the tests: the model zoo (:mod:`lipdp.recipes.zoo`) and the private hyper-parameter
search (:mod:`lipdp.recipes.tuning`)."""
