"""Ahead-of-time builds: targets and their flags (targets, tuning), running
iree-compile (compiler, isa), the build and its manifest (aot), the
artifact directory format (artifacts), the default sets and a model's set
(default_sets, model_set). Only aot and compiler import the compiler, and
only when they build."""
