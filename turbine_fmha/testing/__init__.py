"""The float64 reference that tests and `turbine-fmha run` compare
against (reference)."""
