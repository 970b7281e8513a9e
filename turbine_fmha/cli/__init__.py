"""The `turbine-fmha` command line: main (build, list, inspect), problem
(run, bench) and common (flags and errors)."""
